"""Write GSM8K train/test parquet for multi-turn rollouts with the answer tool, in verl's layout.

    python examples/data_preprocess/gsm8k_multiturn_w_tool.py --local_dir ~/data/gsm8k_tool          # HF hub
    python examples/data_preprocess/gsm8k_multiturn_w_tool.py --local_dataset_path ./gsm8k_raw --local_dir ...

Each row: agent_name "tool_agent"; a system prompt naming the `calc_gsm8k_reward` tool; the ground
truth both under reward_model (for the final score) and under extra_info.tools_kwargs, where the
tool's create() finds it (tool YAML: examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml).
"""

from gsm8k import DATA_SOURCE, INSTRUCTION, ground_truth_of
from hub_or_local import convert_hub_dataset

AGENT_NAME = "tool_agent"
TOOL_NAME = "calc_gsm8k_reward"
SYSTEM_PROMPT = (
    "You are a math expert. Solve the question step by step, reasoning before any tool call. After solving it, "
    f"call the `{TOOL_NAME}` tool with your answer at least once, before giving the final answer, and refine the "
    "answer if the tool says it is wrong. Put your final answer in the format `#### <answer>`.")


def to_row(example: dict, split: str, index: int) -> dict:
    ground_truth = ground_truth_of(example["answer"])
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                   {"role": "user", "content": f"{example['question']} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": example["answer"], "question": example["question"],
                       "need_tools_kwargs": True,
                       "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}}},
    }


def main() -> None:
    convert_hub_dataset(__doc__, "~/data/gsm8k_tool", to_row, hub_name=DATA_SOURCE, hub_config="main")


if __name__ == "__main__":
    main()
