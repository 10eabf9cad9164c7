"""Engines sized for their load (issue #26): how many sequences one rollout engine decodes at once, and the CUDA-graph
batch size that covers them.

An engine captures decode CUDA graphs for batch sizes up to a limit (SGLang's default on an H200 is 256); a decode
step with more sequences in flight runs eagerly, bound by the host CPU's kernel launches. With 512 requests on one
engine (one_step_off, 64 prompts x 8 samples) SGLang ran 92 % of its decode steps outside CUDA graphs
(benchmarks/README.md). The controller computes the peak from the schedule (`engine_load`) and hands it to each
rollout worker; the sglang and vllm rollouts capture graphs up to it (`cuda_graph_size`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLoad:
    peak: int  # sequences one engine decodes at once, at most
    why: str   # the arithmetic behind it, for the engine's start log


def engine_load(config, val_batches: list[tuple[int, int]] = ()) -> EngineLoad:
    """The peak number of sequences one engine decodes at once under the run's schedule (config: the whole PPO
    config; val_batches: (prompts, samples per prompt) of each validation batch, which only the controller knows
    once the validation sets are read).

    Every schedule sends a batch of prompt groups (a prompt and its samples) at once and spreads it evenly over the
    engines: the sync colocated path splits the rows over the ranks and each tensor-parallel group's engine takes
    its ranks' rows; the agent loops send each request to the least-loaded engine server. So

        peak = ceil(prompts in flight x samples per prompt / engines)

    - engines: the GPUs of the pool that holds the rollout / rollout.tensor_model_parallel_size: colocated
      (hybrid_engine=true) trainer.nnodes x trainer.n_gpus_per_node; disaggregated, one_step_off, fully_async: the
      rollout pool's rollout.nnodes x rollout.n_gpus_per_node.
    - prompts in flight: data.train_batch_size, or data_flow.over_sampling_batch_size when larger (the data flow
      requests that many groups at a time); one_step_off generates one batch ahead at a time, so the same;
      fully_async keeps (async_training.max_staleness + 1) x data.train_batch_size groups generating or waiting
      (the data flow's stream, trainer/ppo/group_stream.py, which refuses over-sampling).
    - samples per prompt: rollout.n; a validation batch (its prompts x val_kwargs.n, or an eval set's n) counts
      instead when it is larger.
    """
    data, rollout = config.data, config.actor_rollout_ref.rollout
    pool = config.trainer if config.actor_rollout_ref.hybrid_engine else config.rollout
    engines = pool.nnodes * pool.n_gpus_per_node // rollout.tensor_model_parallel_size
    if config.async_training.mode == "fully_async":
        prompts = (config.async_training.max_staleness + 1) * data.train_batch_size
    else:
        prompts = max(data.train_batch_size, config.data_flow.over_sampling_batch_size or 0)
    batches = [(prompts * rollout.n, prompts, rollout.n, "")]
    batches += [(val_prompts * n, val_prompts, n, "validation ") for val_prompts, n in val_batches]
    sequences, prompts, n, what = max(batches, key=lambda batch: batch[0])
    peak = math.ceil(sequences / engines)
    return EngineLoad(peak, f"peak in-flight {peak} = {prompts} {what}prompts x {n} samples on {engines} "
                            f"engine{'s' if engines > 1 else ''}")


def captured_size(peak: int) -> int:
    """The smallest batch size at or above `peak` that SGLang and vLLM both capture a decode graph for (both
    capture 1, 2, 4, 8, then steps of 8 up to 256, steps of 16 up to 512; SGLang steps of 32 beyond)."""
    if peak <= 8:
        return 1 << (peak - 1).bit_length()
    step = 8 if peak <= 256 else 16 if peak <= 512 else 32
    return math.ceil(peak / step) * step


def cuda_graph_size(engine: str, key: str, config, load: EngineLoad | None, user_keys: list[str]) -> int | None:
    """The engine's largest CUDA-graph batch size for `load` (its argument `key`), logged at the engine's start;
    None when the engine keeps what it has: no graphs (rollout.enforce_eager), the user's own value in
    rollout.engine_kwargs.<engine> (`user_keys`: the graph-size keys it sets; the user wins), or no load known
    (an engine built outside a trainer). Capped at rollout.max_num_seqs: the engine never runs more at once."""
    if config.enforce_eager:
        logger.info("%s: no CUDA graphs (rollout.enforce_eager=true)", engine)
        return None
    if user_keys:
        logger.info("%s: CUDA-graph sizes from rollout.engine_kwargs.%s (%s), not from the schedule%s", engine, engine,
                    ", ".join(user_keys), f" ({load.why})" if load else "")
        return None
    if load is None:
        logger.info("%s: the engine's default CUDA-graph sizes (no schedule load given)", engine)
        return None
    wanted = captured_size(load.peak)
    size = min(wanted, config.max_num_seqs)
    capped = f", capped at rollout.max_num_seqs={config.max_num_seqs}" if size < wanted else ""
    logger.info("%s: %s=%d (%s%s)", engine, key, size, load.why, capped)
    return size
