"""verl's `verl.trainer.ppo.rollout_corr_helper` (its current API, verl >= 0.8), over
hybridrl/algorithms/rollout_correction.py: the same names, arguments, return values and metric names.

verl's functions return the IS weights as a DataProto (batch key `rollout_is_weights`) and plain tensors otherwise;
metrics come back prefixed with `rollout_corr/` from compute_rollout_correction_and_rejection_mask and bare from the
others, as verl's do. verl's distributed batch normalisation (an all-reduce of the weights' mean) is not mirrored:
the mean is this process's.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from hybridrl.algorithms import rollout_correction as _correction
from hybridrl.algorithms.rollout_correction import SAFETY_BOUND, compute_is_metrics
from hybridrl.compat.verl.protocol import DataProto

__all__ = ["SAFETY_BOUND", "SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS", "compute_is_metrics",
           "compute_offpolicy_metrics", "compute_rollout_correction_and_add_to_batch",
           "compute_rollout_correction_and_rejection_mask", "compute_rollout_correction_weights",
           "compute_rollout_rejection_mask"]

SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = set(_correction.RS_DIVERGENCES)
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {option for option in _correction.RS_DIVERGENCES
                                            if option.startswith("token_")}


def compute_rollout_correction_weights(log_ratio: torch.Tensor, response_mask: torch.Tensor,
                                       rollout_is: str = "token", rollout_is_threshold: str | float = 2.0,
                                       rollout_is_batch_normalize: bool = False
                                       ) -> tuple[torch.Tensor, dict[str, float]]:
    return _correction.compute_icepop_or_truncated_is_weights(log_ratio, response_mask, rollout_is,
                                                              rollout_is_threshold, rollout_is_batch_normalize)


def compute_rollout_rejection_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, rollout_rs: str = "token_k1",
                                   rollout_rs_threshold: Optional[str | float] = None
                                   ) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with the rejected tokens set to 0 (response_mask's dtype), and the rollout_rs_* metrics."""
    keep, metrics = _correction.compute_divergence_rejection_mask(log_ratio, response_mask, rollout_rs,
                                                                  rollout_rs_threshold)
    return response_mask * keep.to(response_mask.dtype), metrics


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor],
                              response_mask: torch.Tensor) -> dict[str, Any]:
    return _correction.compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)


def compute_rollout_correction_and_rejection_mask(
        old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
        rollout_is: Optional[str] = None, rollout_is_threshold: Optional[str | float] = 2.0,
        rollout_is_batch_normalize: bool = False, rollout_rs: Optional[str] = None,
        rollout_rs_threshold: Optional[str | float] = None) -> tuple[Optional[DataProto], torch.Tensor, dict]:
    """(IS weights as a DataProto or None, the response mask less the rejected tokens, rollout_corr/ metrics)."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob {tuple(rollout_log_prob.shape)} "
                         f"and response_mask {tuple(response_mask.shape)} must have one shape")
    if not response_mask.bool().any():
        raise ValueError("response_mask has no response token in the whole batch")
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(log_ratio, response_mask, rollout_is,
                                                                 rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(is_metrics)
    corrected_mask = response_mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold; it is None")
        corrected_mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs,
                                                                    rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask))
    weights_proto = None if weights is None else DataProto.from_dict(tensors={"rollout_is_weights": weights})
    return weights_proto, corrected_mask, {_correction.METRIC_PREFIX + key: value for key, value in metrics.items()}


def compute_rollout_correction_and_add_to_batch(batch: DataProto, rollout_corr_config) -> tuple[DataProto, dict]:
    """Apply `algorithm.rollout_correction` (verl's keys, read with .get) to a batch with old_log_probs,
    rollout_log_probs and response_mask; returns the batch (rollout_is_weights added) and the metrics."""
    weights, response_mask, metrics = compute_rollout_correction_and_rejection_mask(
        batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"],
        rollout_is=rollout_corr_config.get("rollout_is", None),
        rollout_is_threshold=rollout_corr_config.get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=rollout_corr_config.get("rollout_is_batch_normalize", False),
        rollout_rs=rollout_corr_config.get("rollout_rs", None),
        rollout_rs_threshold=rollout_corr_config.get("rollout_rs_threshold", None))
    batch.batch["response_mask"] = response_mask
    if weights is not None:
        batch = batch.union(weights)
    return batch, metrics
