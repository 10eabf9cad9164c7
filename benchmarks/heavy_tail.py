"""Heavy-tailed response lengths for the benchmarks: a custom generate function (data_flow.custom_generate_function)
that gives each sample a length budget drawn from its index, so a run's lengths do not depend on what a random
model happens to sample: a `tail_fraction` of the samples get the whole data.max_response_length, the others
`short_length` tokens. On SGLang, `rollout.ignore_eos=true` makes the engine use each budget whole (a tiny random
model on the hf engine rarely ends earlier). The same function serves every layout of a benchmark, so they all
generate the same lengths.
"""
from __future__ import annotations

import os

GENERATE_FILE = '''
import dataclasses
import random

from hybridrl.agent_loop.sample_generate import generate

TAIL_FRACTION, SHORT_LENGTH = {tail_fraction!r}, {short_length!r}


async def heavy_tailed_generate(ctx, sample, sampling_params):
    """The built-in generate with a per-sample budget: the whole response_length for a tail of samples."""
    is_long = random.Random(sample.index).random() < TAIL_FRACTION
    budget = ctx.response_length if is_long else min(SHORT_LENGTH, ctx.response_length)
    return await generate(dataclasses.replace(ctx, response_length=budget), sample, sampling_params)
'''


def heavy_tail_overrides(work_dir: str, tail_fraction: float, short_length: int, device: str) -> list[str]:
    """Writes the generate function into `work_dir`; returns the overrides that run it (through the data flow,
    which runs custom generate functions, in async rollout mode)."""
    path = os.path.join(work_dir, "heavy_tailed.py")
    with open(path, "w") as f:
        f.write(GENERATE_FILE.format(tail_fraction=tail_fraction, short_length=short_length))
    return ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true", "data_flow.enable=true",
            f"data_flow.custom_generate_function.path={path}",
            "data_flow.custom_generate_function.name=heavy_tailed_generate",
            *(["actor_rollout_ref.rollout.ignore_eos=true"] if device == "cuda" else [])]
