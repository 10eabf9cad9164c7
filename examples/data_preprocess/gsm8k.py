"""Write GSM8K train/test parquet in verl's layout (data_source "openai/gsm8k").

    python examples/data_preprocess/gsm8k.py --local_dir ~/data/gsm8k                  # from the HF hub
    python examples/data_preprocess/gsm8k.py --local_dataset_path ./gsm8k_raw --local_dir ~/data/gsm8k

The prompt asks for the final answer after "####", which is what the strict GSM8K scorer reads;
the ground truth is the text after "####" in the reference solution, without thousands separators.
"""

from hub_or_local import convert_hub_dataset

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def ground_truth_of(solution: str) -> str:
    if "####" not in solution:
        raise ValueError(f"GSM8K solution without '####': {solution!r}")
    return solution.split("####")[-1].strip().replace(",", "")


def to_row(example: dict, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth_of(example["answer"])},
        "extra_info": {"split": split, "index": index, "answer": example["answer"], "question": example["question"]},
    }


def main() -> None:
    convert_hub_dataset(__doc__, "~/data/gsm8k", to_row, hub_name=DATA_SOURCE, hub_config="main")


if __name__ == "__main__":
    main()
