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

verl since 0.8 also takes, and `hybridrl.compat.verl.trainer.ppo.rollout_corr_helper` offers through the functions
at the end of this module (the trainer's `algorithm.rollout_correction` keys still take the options above):
  IcePop: rollout_is_threshold "lower_upper" zeroes the weights outside [lower, upper] instead of truncating them;
  divergence rejection: rollout_rs is a comma list of token_k{1,2,3}, seq_sum_k{1,2,3}, seq_mean_k{1,2,3},
    seq_max_k{2,3}; k1 = log(pi_rollout / pi_old) per token, bounded on both sides in log space ("lower_upper"
    ratios), k2 = (log rho)^2 / 2 and k3 = rho - 1 - log rho bounded above; seq_* reduce them per sequence;
  compute_is_metrics: the weights' statistics as applied (after truncation or IcePop), verl's current definitions.
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
RS_DIVERGENCES = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                  "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


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


def compute_offpolicy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: Optional[torch.Tensor], mask: torch.Tensor
                              ) -> dict[str, float]:
    """How far the rollout's distribution is from the trainer's (verl's names; "training" is pi_old here).

    kl = mean over tokens of (log pi_rollout - log pi_old), an estimate of KL(pi_rollout || pi_old);
    k3_kl = mean of rho - log rho - 1; *_ppl = mean over sequences of exp(-token mean log-prob);
    log_ppl_diff = per sequence (mean log pi_rollout - mean log pi_old), its mean, |mean|, max, min;
    ppl_ratio = mean over sequences of exp(log_ppl_diff); chi2_token = mean rho^2 - 1;
    chi2_seq = mean over sequences of (prod rho)^2 - 1 (bounded ratios). Without rollout_log_prob: the training_*
    metrics only.

    Reading chi2: the divergence is never negative, but these are sample means over the rollout's own samples, and
    under a large mismatch the samples where rho is large are rarely drawn: the mean of rho^2 then falls towards 0 and
    the estimate towards -1 (chi2_seq read -1.0 with kl 0.33 on a GPU, benchmarks/README.md, session 28). A chi2 near
    -1 says the mismatch is too large to estimate this way, not that there is none; kl and k3_kl say which."""
    mask = mask.bool()
    has_tokens = mask.any(dim=-1)
    old_log_prob = torch.where(mask, old_log_prob, torch.zeros_like(old_log_prob))
    mean_training = masked_mean(old_log_prob, mask, axis=-1)[has_tokens]
    training = {"training_ppl": float(torch.exp(-mean_training).mean()),
                "training_log_ppl": float((-mean_training).mean())}
    if rollout_log_prob is None:
        return training
    rollout_log_prob = torch.where(mask, rollout_log_prob, torch.zeros_like(rollout_log_prob))
    log_ratio = old_log_prob - rollout_log_prob
    mean_rollout = masked_mean(rollout_log_prob, mask, axis=-1)[has_tokens]
    log_ppl_diff = mean_rollout - mean_training
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_log_ratio = masked_sum(log_ratio, mask, axis=-1)[has_tokens].clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        **training,
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


# ---------------------------------------------------------------------- verl >= 0.8: IcePop, divergence rejection

def parse_is_threshold(spec: float | str) -> tuple[float, Optional[float]]:
    """rollout_is_threshold as verl >= 0.8 takes it: (upper, None) from a number (truncation), (upper, lower) from
    "lower_upper" (IcePop)."""
    if isinstance(spec, bool):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, not a boolean ({spec})")
    if not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {type(spec).__name__}")
    lower_text, _, upper_text = str(spec).strip().rpartition("_")
    try:
        upper, lower = float(upper_text), float(lower_text) if lower_text else None
    except ValueError as bad:
        raise ValueError(f"rollout_is_threshold {spec!r}: expected a number or 'lower_upper' numbers") from bad
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must satisfy 0 < lower <= upper")
    return upper, lower


def parse_rs_thresholds(options: list[str], spec: float | str) -> dict[str, tuple[Optional[float], float]]:
    """Each divergence option's (lower, upper) ratio bounds from rollout_rs_threshold: one entry for all options or
    one per option (comma separated). A k1 option takes "lower_upper" (a lone upper u means 1/u_u); the others take
    an upper bound only (lower None)."""
    if spec is None or isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"rollout_rs_threshold must be a number or a string of thresholds, got {spec!r}")
    entries = [part.strip() for part in str(spec).split(",") if part.strip()]
    if len(entries) == 1:
        entries *= len(options)
    if len(entries) != len(options):
        raise ValueError(f"rollout_rs_threshold {spec!r}: give one threshold for all of {options} or one each")
    bounds = {}
    for option, entry in zip(options, entries):
        lower_text, _, upper_text = entry.rpartition("_")
        if lower_text and not option.endswith("k1"):
            raise ValueError(f"rollout_rs_threshold {entry!r} for {option}: only k1 options take 'lower_upper'")
        try:
            upper = float(upper_text)
            lower = (float(lower_text) if lower_text else 1.0 / upper) if option.endswith("k1") else None
        except (ValueError, ZeroDivisionError) as bad:
            raise ValueError(f"rollout_rs_threshold {entry!r} for {option}: expected positive numbers") from bad
        if not upper > 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold {entry!r} for {option}: bounds must satisfy 0 < lower <= upper")
        bounds[option] = (lower, upper)
    return bounds


def compute_icepop_or_truncated_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str,
                                           threshold: float | str, batch_normalize: bool = False
                                           ) -> tuple[torch.Tensor, dict[str, float]]:
    """verl >= 0.8's IS weights: truncated at a number, or zeroed outside "lower_upper" (IcePop, with
    rollout_is_oob_ratio, the share of tokens zeroed); metrics by compute_is_metrics."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {IS_LEVELS} or null, got {level!r}")
    upper, lower = parse_is_threshold(threshold)
    mask = mask.bool()
    level_log_ratio = _level_log_ratio(log_ratio, mask, level)
    raw_weights = _bounded_weights(level_log_ratio, log_ratio) * mask
    if lower is None:
        weights = raw_weights.clamp(max=upper)
    else:
        inside = (raw_weights >= lower) & (raw_weights <= upper)
        weights = torch.where(inside, raw_weights, torch.zeros_like(raw_weights))
    metrics = compute_is_metrics(weights, raw_weights, level_log_ratio, mask, level, upper, lower)
    if lower is not None:
        out_of_bounds = (raw_weights < lower) | (raw_weights > upper)
        metrics["rollout_is_oob_ratio"] = float(masked_mean(out_of_bounds.float(), mask))
    weights = weights.detach()
    if batch_normalize:
        has_tokens = mask.any(dim=-1)
        weights_mean = (masked_mean(weights, mask) if level == "token"
                        else masked_mean(weights, mask, axis=-1)[has_tokens].mean())
        if weights_mean > 1e-8:
            weights = weights / weights_mean
        metrics["rollout_is_batch_norm_factor"] = float(weights_mean) if weights_mean > 1e-8 else 1.0
    return weights, metrics


def compute_is_metrics(rollout_is_weights: torch.Tensor, raw_rollout_is_weights: torch.Tensor,
                       log_ratio_for_metrics: torch.Tensor, response_mask: torch.Tensor, rollout_is: str,
                       rollout_is_threshold: float, rollout_is_threshold_lower: Optional[float] = None
                       ) -> dict[str, float]:
    """verl >= 0.8's rollout_is_* statistics. mean, max/min (token level), std, effective sample size and seq_mean..
    describe the weights as applied (std and ESS clamped to [0, threshold]); ratio_fraction_* and
    seq_fraction_* the raw ratios (a truncated weight never exceeds the threshold); at sequence level max/min and
    ratio_fraction_* come from each sequence's unbounded log ratio (log_ratio_for_metrics, (batch, 1))."""
    mask = response_mask.bool()
    if not mask.any():
        raise ValueError("compute_is_metrics: response_mask has no response token in the whole batch")
    upper = rollout_is_threshold
    lower = 1.0 / upper if rollout_is_threshold_lower is None else rollout_is_threshold_lower
    has_tokens = mask.any(dim=-1)
    metrics = {"rollout_is_mean": float(masked_mean(rollout_is_weights, mask))}
    if rollout_is == "sequence":
        per_sequence = log_ratio_for_metrics.reshape(len(mask), -1)[:, 0][has_tokens]
        metrics["rollout_is_max"] = math.exp(min(float(per_sequence.max()), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(float(per_sequence.min()))
        metrics["rollout_is_ratio_fraction_high"] = float((per_sequence > math.log(upper)).float().mean())
        metrics["rollout_is_ratio_fraction_low"] = float((per_sequence < math.log(lower)).float().mean())
    else:
        metrics["rollout_is_max"] = float(rollout_is_weights[mask].max())
        metrics["rollout_is_min"] = float(rollout_is_weights[mask].min())
        metrics["rollout_is_ratio_fraction_high"] = float(masked_mean((raw_rollout_is_weights > upper).float(), mask))
        metrics["rollout_is_ratio_fraction_low"] = float(masked_mean((raw_rollout_is_weights < lower).float(), mask))
    clamped = rollout_is_weights.clamp(min=0.0, max=upper)
    clamped_mean = masked_mean(clamped, mask)
    variance = masked_mean(clamped.square(), mask) - clamped_mean.square()
    metrics["rollout_is_std"] = float(variance.clamp(min=0).sqrt()) if int(mask.sum()) > 1 else 0.0
    metrics["rollout_is_eff_sample_size"] = 1.0 / float(masked_mean((clamped / (clamped_mean + 1e-8)).square(), mask))
    seq_means = masked_mean(rollout_is_weights, mask, axis=-1)[has_tokens]
    raw_seq_means = masked_mean(raw_rollout_is_weights, mask, axis=-1)[has_tokens]
    metrics.update({
        "rollout_is_seq_mean": float(seq_means.mean()),
        "rollout_is_seq_std": float(seq_means.std()) if seq_means.numel() > 1 else 0.0,
        "rollout_is_seq_max": float(seq_means.max()),
        "rollout_is_seq_min": float(seq_means.min()),
        "rollout_is_seq_max_deviation": float((seq_means - 1.0).abs().max()),
        "rollout_is_seq_fraction_high": float((raw_seq_means > upper).float().mean()),
        "rollout_is_seq_fraction_low": float((raw_seq_means < lower).float().mean()),
    })
    return metrics


def _token_divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    bounded = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -bounded, "k2": 0.5 * bounded.square(), "k3": torch.exp(bounded) - 1.0 - bounded}


def _per_sequence(values: torch.Tensor, mask: torch.Tensor, reduction: str) -> torch.Tensor:
    """seq_sum / seq_mean / seq_max of a token statistic over each row's response tokens: (batch,)."""
    if reduction == "seq_sum":
        return masked_sum(values, mask, axis=-1)
    if reduction == "seq_mean":
        return masked_mean(values, mask, axis=-1)
    maxima = values.masked_fill(~mask, float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(maxima), torch.zeros_like(maxima), maxima)


def compute_divergence_rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, rollout_rs: str,
                                      rollout_rs_threshold: float | str) -> tuple[torch.Tensor, dict[str, float]]:
    """verl >= 0.8's rejection: a bool keep-mask (batch, length), True where every option of the comma list
    `rollout_rs` keeps the token (a seq_* option keeps or drops whole sequences), and the rollout_rs_* metrics:
    per option its statistic's rollout_rs_<option>_* and masked fractions, then the combined masked fractions."""
    options = list(dict.fromkeys(part.strip() for part in str(rollout_rs).split(",") if part.strip()))
    unknown = [option for option in options if option not in RS_DIVERGENCES]
    if not options or unknown:
        raise ValueError(f"rollout_rs {rollout_rs!r}: options must be from {RS_DIVERGENCES}")
    bounds = parse_rs_thresholds(options, rollout_rs_threshold)
    mask = mask.bool()
    divergences = _token_divergences(log_ratio)
    keep_all = torch.ones_like(mask)
    metrics: dict[str, float] = {}
    for option in options:
        scope, divergence = option.rsplit("_", 1)
        lower, upper = bounds[option]
        # k1 is a log ratio: its bounds are the logs of the ratio bounds; k2 and k3 are bounded above only
        low, high = (math.log(lower), math.log(upper)) if divergence == "k1" else (None, upper)
        per_sequence = None if scope == "token" else _per_sequence(divergences[divergence], mask, scope)
        statistic = divergences[divergence] if per_sequence is None else per_sequence.unsqueeze(-1).expand_as(log_ratio)
        keep = statistic <= high if low is None else (statistic >= low) & (statistic <= high)
        metrics.update(divergence_statistics(f"rollout_rs_{option}", statistic, per_sequence, mask, low, high))
        metrics[f"rollout_rs_{option}_masked_fraction"] = float(masked_mean((~keep).float(), mask))
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = _rejected_sequence_share(keep, mask)
        keep_all &= keep
    metrics["rollout_rs_masked_fraction"] = float(masked_mean((~keep_all).float(), mask))
    metrics["rollout_rs_seq_masked_fraction"] = float((mask & ~keep_all).any(dim=-1).float().mean())
    return keep_all, metrics


def _rejected_sequence_share(keep: torch.Tensor, mask: torch.Tensor) -> float:
    has_tokens = mask.any(dim=-1)
    if not has_tokens.any():
        return 0.0
    return float((mask & ~keep).any(dim=-1)[has_tokens].float().mean())


def divergence_statistics(prefix: str, statistic: torch.Tensor, per_sequence: Optional[torch.Tensor],
                          mask: torch.Tensor, low: Optional[float], high: float) -> dict[str, float]:
    """verl's statistics of one rejection option: mean over tokens; max/min and fraction_high/low over sequences
    (seq_* options) or tokens; std of the statistic clamped to [low or 0, high]; seq_* of each sequence's value
    (its seq_* statistic, or its token mean). fraction_low is 0 and seq_fraction_low absent without a lower bound."""
    has_tokens = mask.any(dim=-1)
    sequences = (masked_mean(statistic, mask, axis=-1) if per_sequence is None else per_sequence)[has_tokens]
    metrics = {f"{prefix}_mean": float(masked_mean(statistic, mask))}
    if per_sequence is not None:
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = float(sequences.max()), float(sequences.min())
        metrics[f"{prefix}_fraction_high"] = float((sequences > high).float().mean())
        metrics[f"{prefix}_fraction_low"] = 0.0 if low is None else float((sequences < low).float().mean())
    else:
        metrics[f"{prefix}_max"], metrics[f"{prefix}_min"] = float(statistic[mask].max()), float(statistic[mask].min())
        metrics[f"{prefix}_fraction_high"] = float(masked_mean((statistic > high).float(), mask))
        metrics[f"{prefix}_fraction_low"] = 0.0 if low is None else float(masked_mean((statistic < low).float(), mask))
    clamped = statistic.clamp(min=0.0 if low is None else low, max=high)
    variance = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
    metrics[f"{prefix}_std"] = float(variance.clamp(min=0).sqrt()) if int(mask.sum()) > 1 else 0.0
    metrics.update({
        f"{prefix}_seq_mean": float(sequences.mean()),
        f"{prefix}_seq_std": float(sequences.std()) if sequences.numel() > 1 else 0.0,
        f"{prefix}_seq_max": float(sequences.max()),
        f"{prefix}_seq_min": float(sequences.min()),
        f"{prefix}_seq_max_deviation": float(sequences.abs().max()),
        f"{prefix}_seq_fraction_high": float((sequences > high).float().mean()),
    })
    if low is not None:
        metrics[f"{prefix}_seq_fraction_low"] = float((sequences < low).float().mean())
    return metrics
