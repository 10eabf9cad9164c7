"""verl's parquet layout for RL prompt data, and the one writer every preprocess script uses.

One row:
    data_source   str                      which scorer grades it ("openai/gsm8k", "reasoning_gym/chain_sum")
    prompt        list of chat messages    [{"role": "user", "content": "..."}]
    ability       str                      free-form tag ("math", "reasoning")
    reward_model  {"style": "rule", "ground_truth": ...}
    extra_info    dict                     whatever the scorer needs (split, index, task metadata)

Kept apart from `dataset.py` so that the preprocess scripts do not import torch.
"""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq

LAYOUT_COLUMNS = ("data_source", "prompt", "ability", "reward_model", "extra_info")


def write_rl_parquet(rows: list[dict], path: str) -> None:
    """Write rows with exactly LAYOUT_COLUMNS (in that order) to `path`, creating its directory."""
    for position, row in enumerate(rows):
        if tuple(row) != LAYOUT_COLUMNS:
            raise ValueError(f"row {position} has columns {list(row)}, expected {list(LAYOUT_COLUMNS)}")
        if "ground_truth" not in row["reward_model"]:
            raise ValueError(f"row {position}: reward_model has no 'ground_truth' ({row['reward_model']!r})")
        if not isinstance(row["prompt"], list) or not all({"role", "content"} <= set(m) for m in row["prompt"]):
            raise ValueError(f"row {position}: prompt must be a list of {{'role', 'content'}} messages, "
                             f"got {row['prompt']!r}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
