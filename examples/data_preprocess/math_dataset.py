"""Write MATH (Hendrycks) train/test parquet in verl's layout (data_source "DigitalLearningGmbH/MATH-lighteval").

    python examples/data_preprocess/math_dataset.py --local_dir ~/data/math                  # from the HF hub
    python examples/data_preprocess/math_dataset.py --local_dataset_path ./math_raw --local_dir ~/data/math

The prompt asks for the final answer in \\boxed{}, which is what the MATH scorer reads; the ground
truth is the content of the last \\boxed{} of the reference solution.
"""

from hub_or_local import convert_hub_dataset

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
    convert_hub_dataset(__doc__, "~/data/math", to_row, hub_name=DATA_SOURCE)


if __name__ == "__main__":
    main()
