"""verl's parquet layout for RL prompt data, and the one writer every preprocess script uses.

One row:
    data_source   str                      which scorer grades it ("openai/gsm8k", "reasoning_gym/chain_sum")
    prompt        list of chat messages    [{"role": "user", "content": "..."}]
    ability       str                      free-form tag ("math", "reasoning")
    reward_model  {"style": "rule", "ground_truth": ...}
    extra_info    dict                     whatever the scorer needs (split, index, task metadata)

Multi-turn data may add `agent_name` (the agent loop that runs the row, e.g. "tool_agent") right
after data_source, as verl's multi-turn preprocess scripts do.

Kept apart from `dataset.py` so that the preprocess scripts do not import torch.
"""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

LAYOUT_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")
AGENT_LAYOUT_COLUMNS = ("data_source", "agent_name", "prompt", "ability", "reward_model", "extra_info")


def write_rl_parquet(rows: list[dict], path: str) -> None:
    """Write rows with exactly LAYOUT_COLUMNS or AGENT_LAYOUT_COLUMNS (in that order, the same for every
    row) to `path`, creating its directory."""
    for position, row in enumerate(rows):
        expected = AGENT_LAYOUT_COLUMNS if "agent_name" in row else LAYOUT_COLUMNS
        if tuple(row) != expected or (position and tuple(row) != tuple(rows[0])):
            raise ValueError(f"row {position} has columns {list(row)}, expected {list(LAYOUT_COLUMNS)} or "
                             f"{list(AGENT_LAYOUT_COLUMNS)}, the same in every row")
        if "agent_name" in row and not (isinstance(row["agent_name"], str) and row["agent_name"]):
            raise ValueError(f"row {position}: agent_name must be a non-empty string, got {row['agent_name']!r}")
        if "ground_truth" not in row["reward_model"]:
            raise ValueError(f"row {position}: reward_model has no 'ground_truth' ({row['reward_model']!r})")
        if not isinstance(row["prompt"], list) or not all({"role", "content"} <= set(m) for m in row["prompt"]):
            raise ValueError(f"row {position}: prompt must be a list of {{'role', 'content'}} messages, "
                             f"got {row['prompt']!r}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
