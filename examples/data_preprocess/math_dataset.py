"""Write MATH (Hendrycks) train/test parquet in verl's layout (data_source "DigitalLearningGmbH/MATH-lighteval").

    python examples/data_preprocess/math_dataset.py --local_dir ~/data/math                  # from the HF hub
    python examples/data_preprocess/math_dataset.py --local_dataset_path ./math_raw --local_dir ~/data/math

The prompt asks for the final answer in \\boxed{}, which is what the MATH scorer reads; the ground
truth is the content of the last \\boxed{} of the reference solution.
"""
import argparse
import os

from hub_or_local import load_split

from hybridrl.utils.rl_parquet import write_rl_parquet
from hybridrl.reward.scorers.math import last_boxed_only_string, remove_boxed

DATA_SOURCE = "DigitalLearningGmbH/MATH-lighteval"
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def ground_truth_of(solution: str) -> str:
    boxed = last_boxed_only_string(solution)
    if boxed is None:
        raise ValueError(f"MATH solution without \\boxed{{}}: {solution!r}")
    return remove_boxed(boxed)


def to_row(example: dict, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{example['problem']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth_of(example["solution"])},
        "extra_info": {"split": split, "index": index},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dataset_path", default=None, help="offline copy: a dir with train*/test* files")
    parser.add_argument("--local_dir", default="~/data/math")
    args = parser.parse_args()

    for split in ("train", "test"):
        examples = load_split(split, args.local_dataset_path, hub_name=DATA_SOURCE)
        rows = [to_row(example, split, index) for index, example in enumerate(examples)]
        path = os.path.join(os.path.expanduser(args.local_dir), f"{split}.parquet")
        write_rl_parquet(rows, path)
        print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    main()
