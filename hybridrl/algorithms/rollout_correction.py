"""Rollout-training mismatch correction (verl's `algorithm.rollout_correction`, decoupled mode).

The engine that generated a response (SGLang in bf16, an older policy in asynchronous training) is not
exactly the policy the trainer scores (`old_log_probs`, FSDP in fp32). PPO's ratio pi/pi_old then corrects
for the wrong distribution: the samples were drawn from pi_rollout. With the rollout's own log-probs
(`rollout.calculate_log_probs=true` puts `rollout_log_probs` in the batch) the per-token ratio

    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(old_log_probs - rollout_log_probs)

gives two corrections, each optional and independent:

  importance sampling (`rollout_is`): every token's policy loss is multiplied by a weight (the policy loss
    reads `rollout_is_weights`), truncated at `rollout_is_threshold` (TIS):
      token     w_t = min(rho_t, threshold)
      sequence  w_t = min(prod_t rho_t, threshold), the same for every token of the sequence
    optionally divided by their batch mean (`rollout_is_batch_normalize`; tokens for token level,
    sequences for sequence level);
  rejection sampling (`rollout_rs`): tokens or whole sequences whose ratio lies outside
    [rollout_rs_threshold_lower (default 1/upper), rollout_rs_threshold] leave `response_mask`, so they are in
    no loss and in no loss denominator:
      token      rho_t per token
      sequence   prod_t rho_t, per sequence
      geometric  exp(mean_t log rho_t), per sequence
  veto (`rollout_token_veto_threshold`): a sequence with any token whose rho_t is below it leaves
    response_mask entirely (one catastrophic token is enough to reject its sequence).

Ratios are taken in log space and bounded to exp(+-20) before exp, so a sequence of many tokens cannot
overflow. Weights are 0 outside response_mask and carry no gradient (they change the measure, not the
objective). With both rollout_is and rollout_rs null and no veto, only the metrics are computed.

Metrics (all under `rollout_corr/`, verl's names): the weights' and the rejection ratios' statistics
(rollout_is_*, rollout_rs_*), what the veto and the rejection removed (rollout_is_veto_fraction,
rollout_rs_masked_fraction, ...) and the mismatch itself (kl, k3_kl, training_ppl, rollout_ppl, chi2_token,
chi2_seq, ...). Pure torch on (batch, response_length) tensors; no I/O, no workers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from hybridrl.algorithms.torch_functional import masked_mean, masked_sum

SAFETY_BOUND = 20.0  # |log ratio| is bounded by this before exp: exp(20) ~ 4.9e8
METRIC_PREFIX = "rollout_corr/"
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclass
class RolloutCorrectionResult:
    """What the correction gives the batch: the weights (None without rollout_is), the response mask with the
    rejected tokens removed, and the metrics (already prefixed with rollout_corr/)."""
    rollout_is_weights: Optional[torch.Tensor]
    response_mask: torch.Tensor
    metrics: dict[str, float]


def corrects(config: Any) -> bool:
    """Whether `algorithm.rollout_correction` changes training (weights, rejection or veto), not only measures."""
    return (config.rollout_is is not None or config.rollout_rs is not None
            or config.rollout_token_veto_threshold is not None)


# ---------------------------------------------------------------------- the whole correction

def compute_rollout_correction_and_rejection_mask(
        old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
        rollout_is: Optional[str] = None, rollout_is_threshold: float = 2.0,
        rollout_is_batch_normalize: bool = False, rollout_rs: Optional[str] = None,
        rollout_rs_threshold: Optional[float] = None, rollout_rs_threshold_lower: Optional[float] = None,
        rollout_token_veto_threshold: Optional[float] = None) -> RolloutCorrectionResult:
    """IS weights, the rejection-and-veto mask and all metrics for one batch (see the module docstring)."""
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"old_log_probs {tuple(old_log_prob.shape)}, rollout_log_probs "
                         f"{tuple(rollout_log_prob.shape)} and response_mask {tuple(response_mask.shape)} must have "
                         "one shape (batch, response_length)")
    mask = response_mask.bool()
    if not mask.any():
        raise ValueError("rollout correction: response_mask has no response token in the whole batch")
    # Outside the mask the log-probs may be anything (padding, a tool's tokens): they must not enter a sum.
    log_ratio = old_log_prob.float() - rollout_log_prob.float()
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_is_weights(log_ratio, mask, rollout_is, rollout_is_threshold,
                                                         rollout_is_batch_normalize)
        metrics.update(is_metrics)
    kept = mask.clone()
    if rollout_rs is not None:
        if rollout_rs_threshold is None:
            raise ValueError("rollout_rs is set but rollout_rs_threshold is null: rejection needs an upper threshold")
        rs_mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, mask, rollout_rs, rollout_rs_threshold,
                                                             rollout_rs_threshold_lower)
        kept &= rs_mask
        metrics.update(rs_metrics)
    veto_keep, veto_metrics = compute_token_veto(log_ratio, mask, rollout_token_veto_threshold)
    kept &= veto_keep
    metrics.update(veto_metrics)
    metrics.update(compute_offpolicy_metrics(old_log_prob.float(), rollout_log_prob.float(), mask))
    return RolloutCorrectionResult(weights, kept.to(response_mask.dtype),
                                   {METRIC_PREFIX + key: value for key, value in metrics.items()})


def compute_rollout_correction_and_add_to_batch(batch, config: Any) -> dict[str, float]:
    """Apply `algorithm.rollout_correction` to a training batch (a DataProto with old_log_probs,
    rollout_log_probs and response_mask): response_mask loses the rejected tokens, rollout_is_weights is added
    when rollout_is is set. Returns the rollout_corr/ metrics. Runs on the controller before the advantages."""
    tensors = batch.batch
    if "rollout_log_probs" not in tensors.keys():
        raise KeyError("algorithm.rollout_correction needs rollout_log_probs in the batch; the rollout returned "
                       "none (set actor_rollout_ref.rollout.calculate_log_probs=true)")
    result = compute_rollout_correction_and_rejection_mask(
        tensors["old_log_probs"], tensors["rollout_log_probs"], tensors["response_mask"],
        rollout_is=config.rollout_is, rollout_is_threshold=config.rollout_is_threshold,
        rollout_is_batch_normalize=config.rollout_is_batch_normalize, rollout_rs=config.rollout_rs,
        rollout_rs_threshold=config.rollout_rs_threshold, rollout_rs_threshold_lower=config.rollout_rs_threshold_lower,
        rollout_token_veto_threshold=config.rollout_token_veto_threshold)
    tensors["response_mask"] = result.response_mask
    if result.rollout_is_weights is not None:
        tensors["rollout_is_weights"] = result.rollout_is_weights
    return result.metrics


def apply_rollout_is_weights(pg_losses: torch.Tensor, rollout_is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """The per-token policy loss times its IS weight (as is when there are none). Policy losses call this on
    their per-token loss before aggregating it."""
    if rollout_is_weights is None:
        return pg_losses
    return pg_losses * rollout_is_weights.to(pg_losses.dtype).detach()


# ---------------------------------------------------------------------- importance sampling

def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per row: the sum (sequence) or mean (geometric) of the token log ratios, shape (batch, 1)."""
    if level == "sequence":
        return masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
    return masked_mean(log_ratio, mask, axis=-1).unsqueeze(-1)


def _level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The unbounded log ratio at the level: per token (batch, length) or per sequence (batch, 1)."""
    return log_ratio if level == "token" else _sequence_log_ratio(log_ratio, mask, level)


def _bounded_weights(level_log_ratio: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """exp of the log ratio bounded to +-SAFETY_BOUND, broadcast to every token: (batch, length)."""
    return torch.exp(level_log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(like)


def compute_rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float,
                               batch_normalize: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights (batch, length), 0 outside the mask, and their rollout_is_* metrics.

    The metrics describe the weights before truncation (how often the threshold binds), as verl's do."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS} or null, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    level_log_ratio = _level_log_ratio(log_ratio, mask, level)
    weights = _bounded_weights(level_log_ratio, log_ratio) * mask
    metrics = ratio_statistics("rollout_is", weights, level_log_ratio, mask, level, threshold, 1.0 / threshold)
    weights = weights.clamp(max=threshold).detach()
    if batch_normalize:
        if level == "token":
            weights_mean = masked_mean(weights, mask)
        else:  # one weight per sequence with a response token
            has_tokens = mask.any(dim=-1)
            weights_mean = masked_mean(weights, mask, axis=-1)[has_tokens].mean()
        if weights_mean > 1e-8:
            weights = weights / weights_mean
        metrics["rollout_is_batch_norm_factor"] = float(weights_mean) if weights_mean > 1e-8 else 1.0
    return weights, metrics


# ---------------------------------------------------------------------- rejection and veto

def compute_rollout_rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, upper: float,
                                   lower: Optional[float] = None) -> tuple[torch.Tensor, dict[str, float]]:
    """A bool mask (batch, length): True where the ratio at `level` lies in [lower, upper] (lower defaults to
    1/upper); and the rollout_rs_* metrics, with the share of tokens and of sequences it rejects."""
    if level not in RS_LEVELS:
        raise ValueError(f"rollout_rs must be one of {RS_LEVELS} or null, got {level!r}")
    lower = 1.0 / upper if lower is None else lower
    if not 0 < lower < upper:
        raise ValueError(f"rejection thresholds must satisfy 0 < rollout_rs_threshold_lower ({lower}) < "
                         f"rollout_rs_threshold ({upper})")
    level_log_ratio = _level_log_ratio(log_ratio, mask, level)
    # Compared in log space: a sequence's product can be far beyond exp(20) and still must count as "above".
    inside = (level_log_ratio >= math.log(lower)) & (level_log_ratio <= math.log(upper))
    keep = inside.expand_as(log_ratio)
    weights = _bounded_weights(level_log_ratio, log_ratio) * mask
    metrics = ratio_statistics("rollout_rs", weights, level_log_ratio, mask, level, upper, lower)
    rejected = mask & ~keep
    metrics["rollout_rs_masked_fraction"] = float(masked_mean(rejected.float(), mask))
    has_tokens = mask.any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = float(rejected.any(dim=-1)[has_tokens].float().mean())
    return keep, metrics


def compute_token_veto(log_ratio: torch.Tensor, mask: torch.Tensor, veto_threshold: Optional[float]
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """Keep-mask that drops every sequence holding a token with rho_t < veto_threshold (None: keep all)."""
    if veto_threshold is None:
        return torch.ones_like(mask), {"rollout_is_veto_fraction": 0.0, "rollout_is_catastrophic_token_fraction": 0.0}
    if not veto_threshold > 0:
        raise ValueError(f"rollout_token_veto_threshold must be > 0, got {veto_threshold}")
    catastrophic = (log_ratio < math.log(veto_threshold)) & mask
    vetoed = catastrophic.any(dim=-1, keepdim=True)
    metrics = {"rollout_is_veto_fraction": float(vetoed.float().mean()),
               "rollout_is_catastrophic_token_fraction": float(masked_mean(catastrophic.float(), mask))}
    return (~vetoed).expand_as(mask), metrics


# ---------------------------------------------------------------------- metrics

def ratio_statistics(prefix: str, weights: torch.Tensor, level_log_ratio: torch.Tensor, mask: torch.Tensor,
                     level: str, upper: float, lower: float) -> dict[str, float]:
    """verl's statistics of IS / rejection ratios under `prefix` (rollout_is or rollout_rs).

    weights: the bounded, untruncated ratios broadcast to tokens (0 outside the mask). Token means are over
    response tokens; *_max/*_min/*_fraction_* are over tokens (token level) or sequences (sequence levels,
    taken from the unbounded log ratio, so a product beyond exp(20) still counts as above the threshold);
    std and the effective sample size use the ratios clamped to [lower, upper]; seq_* describe each sequence's
    mean weight."""
    has_tokens = mask.any(dim=-1)
    metrics = {f"{prefix}_mean": float(masked_mean(weights, mask))}
    if level == "token":
        valid = weights[mask]
        metrics[f"{prefix}_max"] = float(valid.max())
        metrics[f"{prefix}_min"] = float(valid.min())
        metrics[f"{prefix}_ratio_fraction_high"] = float((valid > upper).float().mean())
        metrics[f"{prefix}_ratio_fraction_low"] = float((valid < lower).float().mean())
    else:
        per_sequence = level_log_ratio.squeeze(-1)[has_tokens]
        metrics[f"{prefix}_max"] = math.exp(min(float(per_sequence.max()), SAFETY_BOUND))
        metrics[f"{prefix}_min"] = math.exp(float(per_sequence.min()))
        metrics[f"{prefix}_ratio_fraction_high"] = float((per_sequence > math.log(upper)).float().mean())
        metrics[f"{prefix}_ratio_fraction_low"] = float((per_sequence < math.log(lower)).float().mean())
    clamped = weights.clamp(min=lower, max=upper)
    clamped_mean = masked_mean(clamped, mask)
    variance = masked_mean(clamped.square(), mask) - clamped_mean.square()
    metrics[f"{prefix}_std"] = float(variance.clamp(min=0).sqrt()) if int(mask.sum()) > 1 else 0.0
    metrics[f"{prefix}_eff_sample_size"] = 1.0 / float(masked_mean((clamped / (clamped_mean + 1e-8)).square(), mask))
    seq_means = masked_mean(weights, mask, axis=-1)[has_tokens]
    metrics[f"{prefix}_seq_mean"] = float(seq_means.mean())
    metrics[f"{prefix}_seq_std"] = float(seq_means.std()) if seq_means.numel() > 1 else 0.0
    metrics[f"{prefix}_seq_max"] = float(seq_means.max())
    metrics[f"{prefix}_seq_min"] = float(seq_means.min())
    metrics[f"{prefix}_seq_max_deviation"] = float((seq_means - 1.0).abs().max())
    metrics[f"{prefix}_seq_fraction_high"] = float((seq_means > upper).float().mean())
    metrics[f"{prefix}_seq_fraction_low"] = float((seq_means < lower).float().mean())
    return metrics


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor
                              ) -> dict[str, float]:
    """How far the rollout's distribution is from the trainer's (verl's names; "training" is pi_old here).

    kl = mean over tokens of (log pi_rollout - log pi_old), an estimate of KL(pi_rollout || pi_old);
    k3_kl = mean of rho - log rho - 1; *_ppl = mean over sequences of exp(-token mean log-prob);
    log_ppl_diff = per sequence (mean log pi_rollout - mean log pi_old), its mean, |mean|, max, min;
    ppl_ratio = mean over sequences of exp(log_ppl_diff); chi2_token = mean rho^2 - 1;
    chi2_seq = mean over sequences of (prod rho)^2 - 1 (bounded ratios).

    Reading chi2: the divergence is never negative, but these are sample means over the rollout's own samples, and
    under a large mismatch the samples where rho is large are rarely drawn: the mean of rho^2 then falls towards 0 and
    the estimate towards -1 (chi2_seq read -1.0 with kl 0.33 on a GPU, benchmarks/README.md, session 28). A chi2 near
    -1 says the mismatch is too large to estimate this way, not that there is none; kl and k3_kl say which."""
    has_tokens = mask.any(dim=-1)
    old_log_prob = torch.where(mask, old_log_prob, torch.zeros_like(old_log_prob))
    rollout_log_prob = torch.where(mask, rollout_log_prob, torch.zeros_like(rollout_log_prob))
    log_ratio = old_log_prob - rollout_log_prob
    mean_training = masked_mean(old_log_prob, mask, axis=-1)[has_tokens]
    mean_rollout = masked_mean(rollout_log_prob, mask, axis=-1)[has_tokens]
    log_ppl_diff = mean_rollout - mean_training
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_log_ratio = masked_sum(log_ratio, mask, axis=-1)[has_tokens].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-mean_training).mean()),
        "training_log_ppl": float((-mean_training).mean()),
        "kl": float(masked_mean(rollout_log_prob - old_log_prob, mask)),
        "k3_kl": float(masked_mean(torch.exp(bounded) - bounded - 1, mask)),
        "rollout_ppl": float(torch.exp(-mean_rollout).mean()),
        "rollout_log_ppl": float((-mean_rollout).mean()),
        "log_ppl_diff": float(log_ppl_diff.mean()),
        "log_ppl_abs_diff": float(log_ppl_diff.abs().mean()),
        "log_ppl_diff_max": float(log_ppl_diff.max()),
        "log_ppl_diff_min": float(log_ppl_diff.min()),
        "ppl_ratio": float(torch.exp(log_ppl_diff).mean()),
        "chi2_token": float(masked_mean(torch.exp(bounded).square(), mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log_ratio).mean() - 1.0),
    }
