"""The sampling seed of each generate request under `actor_rollout_ref.rollout.full_determinism` (verl's key).

An engine that samples a batch from one generator gives a row different tokens when the batch around it changes:
which requests an engine server batches together depends on when they arrive, and so does which server gets them.
With full_determinism every request carries its own seed, derived from what identifies it in the run and nothing
else: (rollout.seed, training step, training or validation, the row of the step's batch, the turn of its
conversation). The row is the sample's place in its step's generation (trainer/ppo/group_rollout.py): its group's
index among the groups the step submitted x rollout.n + its index in the group, which is also its row in the batched
engine call (generate.BatchGenerate); so a row's tokens do not depend on the timing of the others, on the server it
lands on, or on the order the answers come back. A ReMax baseline (greedy) gets a seed of its group's own.

How each engine takes the seed:
- hf, batch path (rollout.mode=sync): one `generate` call per rank samples its rows from one generator, seeded from
  the rank's first row; the batch a rank gets is fixed by the config, so the call repeats bit for bit (the tokens
  change with the number of ranks, which cuts the batch differently);
- hf engine server: a seeded request is generated alone (no batch: HF generate draws every row from one generator);
- sglang: `sampling_seed` per request, the engine started with enable_deterministic_inference (batch-invariant
  kernels);
- vllm: SamplingParams.seed per request, the engine started with VLLM_BATCH_INVARIANT=1.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from hybridrl.utils.determinism import stable_seed

STEP_KEY = "global_steps"  # meta_info: the training step a generation belongs to (generate.BatchGenerate sets it)
FIRST_ROW_KEY = "first_row"  # meta_info: the batch row a rank's first prompt is (the worker sets it)


def row_seed(rollout_config, meta_info: dict[str, Any], row: int) -> Optional[int]:
    """The seed of batch row `row` of this generation; None unless rollout.full_determinism."""
    if not rollout_config.full_determinism:
        return None
    if STEP_KEY not in meta_info:
        raise ValueError(f"actor_rollout_ref.rollout.full_determinism: a generation needs meta_info[{STEP_KEY!r}], the "
                         f"training step its request seeds derive from (generate.BatchGenerate sets it); got "
                         f"meta_info keys {sorted(meta_info)}")
    phase = "validate" if meta_info.get("validate", False) else "train"
    return stable_seed(int(rollout_config.seed), int(meta_info[STEP_KEY]), phase, int(row))


def group_seeds(rollout_config, step: int, validate: bool, position: int, group: list) -> list[Optional[int]]:
    """The seeds of a group's samples (the agent-loop path), the group being the `position`-th (0, 1, ...) its step
    submitted: row position x n + index in the group for each sampled response, a seed of the group's own for its
    ReMax baseline (last, is_baseline); Nones unless rollout.full_determinism."""
    if not rollout_config.full_determinism:
        return [None] * len(group)
    meta_info = {STEP_KEY: step, "validate": validate}
    n = sum(not sample.is_baseline for sample in group)
    return [stable_seed(int(rollout_config.seed), int(step), "baseline", position) if sample.is_baseline
            else row_seed(rollout_config, meta_info, position * n + index) for index, sample in enumerate(group)]


def turn_seed(seed_of_row: int, turn: int) -> int:
    """The seed of the `turn`-th generate call (0, 1, ...) of one row's conversation (a tool loop's turns)."""
    return seed_of_row if turn == 0 else stable_seed(seed_of_row, turn)


def first_row_seed(rollout_config, meta_info: dict[str, Any]) -> Optional[int]:
    """The seed of a rank's first row (the hf batch path's generator); None unless rollout.full_determinism."""
    return row_seed(rollout_config, meta_info, _first_row(meta_info)) if rollout_config.full_determinism else None


def batch_row_seeds(rollout_config, meta_info: dict[str, Any], rows: int) -> list[Optional[int]]:
    """The seeds of a rank's `rows` rows (sglang's and vllm's batch paths); Nones unless rollout.full_determinism."""
    if not rollout_config.full_determinism:
        return [None] * rows
    first = _first_row(meta_info)
    return [row_seed(rollout_config, meta_info, first + row) for row in range(rows)]


def _first_row(meta_info: dict[str, Any]) -> int:
    if FIRST_ROW_KEY not in meta_info:
        raise ValueError(f"actor_rollout_ref.rollout.full_determinism: a rank's generation needs "
                         f"meta_info[{FIRST_ROW_KEY!r}], the batch row of its first prompt (the worker's "
                         f"generate_sequences sets it); got meta_info keys {sorted(meta_info)}")
    return int(meta_info[FIRST_ROW_KEY])


@contextlib.contextmanager
def seeded_generator(seed: Optional[int], device: torch.device) -> Iterator[None]:
    """HF generate inside draws from torch's generator seeded with `seed`, and the process's own RNG state is back
    afterwards (training and the other calls draw as before); seed None: nothing changes."""
    if seed is None:
        yield
        return
    cuda_devices = [torch.cuda.current_device() if device.index is None else device.index] \
        if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        yield
