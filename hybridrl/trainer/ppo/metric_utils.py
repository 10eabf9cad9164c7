"""Step metrics under verl's names, so users' dashboards and log parsers keep working.

Everything here reads a finished step's DataProto on the controller; nothing touches a model.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np
import torch

from hybridrl.protocol import DataProto
from hybridrl.utils.metric import Metric


@contextmanager
def timer(name: str, timing: dict[str, float]):
    """Add the block's wall time to `timing[name]` (seconds)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {f"{prefix}/mean": values.mean().item(), f"{prefix}/max": values.max().item(),
            f"{prefix}/min": values.min().item()}


def compute_data_metrics(batch: DataProto, use_critic: bool) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one training batch."""
    response_mask = batch.batch["response_mask"].bool()  # the tokens trained on
    prompt_mask = batch.batch["attention_mask"][:, : -response_mask.shape[1]].bool()
    max_response_length = response_mask.shape[1]
    max_prompt_length = prompt_mask.shape[1]
    # A response's length counts all its tokens, also those an agent loop inserted (response_mask 0 inside the
    # response, e.g. tool output), as verl does: the clip ratio says how many responses hit the length limit.
    response_length = batch.batch["attention_mask"][:, -max_response_length:].sum(-1).float()
    prompt_length = prompt_mask.sum(-1).float()

    metrics = {}
    metrics.update(_stats("critic/score", batch.batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns")):
        metrics.update(_stats(name, batch.batch[key][response_mask]))
    if use_critic:
        values = batch.batch["values"][response_mask]
        returns = batch.batch["returns"][response_mask]
        metrics.update(_stats("critic/values", values))
        explained = 1.0 - torch.var(returns - values) / (torch.var(returns) + 1e-5)
        metrics["critic/vf_explained_var"] = explained.item()
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length == max_response_length).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_length))
    metrics["prompt_length/clip_ratio"] = (prompt_length == max_prompt_length).float().mean().item()
    return metrics


def compute_rollout_probs_diff(batch: DataProto) -> dict[str, float]:
    """|p_rollout - p_actor| per response token (verl's training/rollout_probs_diff_*), when the rollout reported
    its log-probs (rollout.calculate_log_probs): how far the engine's distribution is from the one the trainer
    scores. Near bf16 noise it says the weight sync worked; a sync that sent stale weights shows here first."""
    if "rollout_log_probs" not in batch.batch.keys():
        return {}
    mask = batch.batch["response_mask"].bool()
    diff = (batch.batch["rollout_log_probs"].exp() - batch.batch["old_log_probs"].exp()).abs()[mask]
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_mean": diff.mean().item(), "training/rollout_probs_diff_max": diff.max().item(),
            "training/rollout_probs_diff_std": diff.std().item() if diff.numel() > 1 else 0.0}


def compute_timing_metrics(timing: dict[str, float]) -> dict[str, float]:
    return {f"timing_s/{name}": seconds for name, seconds in timing.items()}


def compute_throughput_metrics(batch: DataProto, timing: dict[str, float], n_workers: int) -> dict[str, float]:
    """Tokens per second per worker over the whole step, as verl reports `perf/throughput`."""
    total_tokens = int(batch.batch["attention_mask"].sum().item())
    step_time = timing["step"]
    return {
        "perf/total_num_tokens": total_tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": total_tokens / (step_time * n_workers),
    }


def reduce_metrics(metrics: dict[str, list | float | Metric]) -> dict[str, float]:
    """Each list-valued metric (workers report per-micro-batch or per-rank values) reduced as verl does: the max
    where the key says "max" (a peak over ranks stays a peak), the min where it says "min", else the mean; a Metric
    by its own aggregation (verl's way to report, e.g., a share of the global loss that must be summed:
    hybridrl/utils/metric.py)."""
    reduced = {}
    for key, value in metrics.items():
        if isinstance(value, Metric):
            reduced[key] = value.aggregate()
        elif isinstance(value, (list, tuple, np.ndarray)):
            reduce = np.max if "max" in key else np.min if "min" in key else np.mean
            reduced[key] = float(reduce(value)) if len(value) else float("nan")
        elif isinstance(value, torch.Tensor):
            reduced[key] = value.float().mean().item()
        else:
            reduced[key] = float(value)
    return reduced


def pop_worker_metrics(output: DataProto, metrics: dict[str, float]) -> DataProto:
    """Move a worker group's own metrics (perf/*, timing_s/<part of the phase>) from output.meta_info into
    `metrics`, averaged over the ranks; returns `output`, ready to be joined to the batch."""
    metrics.update(reduce_metrics(output.meta_info.pop("metrics", {})))
    return output


def mean_of_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from a ONE_TO_ALL call's per-rank dicts: each key's mean over the ranks that report it."""
    collected: dict[str, list[float]] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            collected.setdefault(key, []).append(value)
    return reduce_metrics(collected)


def compute_validation_metrics(data_sources: np.ndarray, scores: torch.Tensor, n: int,
                               extra: dict[str, list] | None = None) -> dict[str, float]:
    """`val-core/{data_source}/reward/mean@n` (plus extras under val-aux) grouped by data source."""
    grouped: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(data_sources, scores.tolist()):
        grouped[str(source)].append(score)
    metrics = {f"val-core/{source}/reward/mean@{n}": float(np.mean(values)) for source, values in grouped.items()}
    for key, values in (extra or {}).items():
        numeric = [v for v in values if isinstance(v, (int, float, bool, np.number))]
        if len(numeric) == len(values) and numeric:
            metrics[f"val-aux/{key}/mean@{n}"] = float(np.mean(numeric))
    return metrics
