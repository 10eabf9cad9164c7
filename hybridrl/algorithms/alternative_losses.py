"""Policy losses that replace PPO's clipped surrogate, under verl's names: cispo, dppo_tv, dppo_kl, sapo,
geo_mean (GMPO), dro and bypass_mode.

Same contract as the losses in `losses.py` (signature, metrics as detached 0-dim tensors, aggregation with the
global batch counts). Besides the actor config keys listed there, these read:

    clip_ratio_c              truncation of the detached IS ratio                            (dppo_tv, dppo_kl)
    tau_pos, tau_neg          SAPO's gate temperatures for positive / other advantages        (sapo)
    policy_loss.dro_beta      weight of DRO's quadratic log-ratio penalty, > 0               (dro)
    policy_loss.rollout_correction  verl's bypass settings: loss_type, rollout_is, ...       (bypass_mode)

For dppo_tv / dppo_kl, clip_ratio(_low/_high) bound a divergence between the token probabilities, not the ratio.
"""
from __future__ import annotations

from typing import Any

import torch

from hybridrl.algorithms.losses import (_clip_bounds, _log_ratio, agg_loss, compute_policy_loss_vanilla,
                                         global_batch_info, register_policy_loss)
from hybridrl.algorithms.rollout_correction import (apply_rollout_is_weights,
                                                    compute_rollout_correction_and_rejection_mask)
from hybridrl.algorithms.torch_functional import masked_mean


def _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights) -> torch.Tensor:
    """The per-token loss, times the rollout IS weights when given, aggregated over the global batch."""
    pg_losses = apply_rollout_is_weights(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info(config))


def _kl_metric(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """actor/ppo_kl: the mean of log(pi_old / pi) over the response tokens."""
    return masked_mean(-log_ratio, response_mask).detach()


@register_policy_loss("cispo")
def compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask,
                              loss_agg_mode: str = "token-mean", config: Any = None,
                              rollout_is_weights: torch.Tensor | None = None):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(r, 1-eps_low, 1+eps_high)) * A * log pi.

    The ratio is clipped and detached, so it only weighs the token's log-prob gradient: unlike PPO no token
    loses its gradient. Metric pg_clipfrac: tokens whose ratio the clip changed.
    """
    eps_low, eps_high = _clip_bounds(config, "cispo")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    metrics = {
        "actor/pg_clipfrac": masked_mean((ratio != clipped_ratio).float(), response_mask).detach(),
        "actor/ppo_kl": _kl_metric(log_ratio, response_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob.device),
    }
    return _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights), metrics


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
               in_trust_region: torch.Tensor):
    """DPPO's loss given which tokens lie in the trust region: -sg(min(r, clip_ratio_c)) * A * log pi there, 0
    outside. Metrics: pg_clipfrac (tokens outside), pg_clipfrac_lower (tokens inside whose ratio was truncated)."""
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    kept = in_trust_region.detach().to(log_prob.dtype)
    pg_losses = -advantages * torch.clamp(ratio, max=config.clip_ratio_c).detach() * log_prob * kept
    metrics = {
        "actor/pg_clipfrac": masked_mean(1.0 - kept, response_mask).detach(),
        "actor/ppo_kl": _kl_metric(log_ratio, response_mask),
        "actor/pg_clipfrac_lower": masked_mean((ratio > config.clip_ratio_c).float() * kept, response_mask).detach(),
    }
    return _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights), metrics


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_is_weights: torch.Tensor | None = None):
    """DPPO-Binary-TV (arXiv 2602.04879): a token keeps its truncated-IS policy gradient while the change of its
    probability stays inside the bound on the side its advantage pushes: p - p_old <= eps_high for A > 0,
    p - p_old >= -eps_low otherwise."""
    eps_low, eps_high = _clip_bounds(config, "dppo_tv")
    probability_change = torch.exp(log_prob) - torch.exp(old_log_prob)
    in_region = torch.where(advantages > 0, probability_change <= eps_high, probability_change >= -eps_low)
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                      in_region)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_is_weights: torch.Tensor | None = None):
    """DPPO-Binary-KL (arXiv 2602.04879): as dppo_tv, with the trust region measured by the KL between the
    Bernoulli distributions (sampled token or not) of the old and new policy, KL(p_old || p). A token whose
    probability moved against its advantage's push always stays in the region."""
    eps_low, eps_high = _clip_bounds(config, "dppo_kl")
    probability, old_probability = torch.exp(log_prob), torch.exp(old_log_prob)
    tiny = 1e-8  # keeps log((1 - p_old) / (1 - p)) finite at p = 1
    binary_kl = (old_probability * (old_log_prob - log_prob)
                 + (1.0 - old_probability) * torch.log((1.0 - old_probability + tiny) / (1.0 - probability + tiny)))
    in_region = torch.where(advantages > 0, (binary_kl <= eps_high) | (probability <= old_probability),
                            (binary_kl <= eps_low) | (probability >= old_probability))
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
                      in_region)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask,
                             loss_agg_mode: str = "seq-mean-token-mean", config: Any = None,
                             rollout_is_weights: torch.Tensor | None = None):
    """SAPO (arXiv 2511.20347): a smooth gate instead of a hard clip, -f(r) * A with
    f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 and tau_neg elsewhere.

    f(1) = 2 / tau and f'(1) = 1, so near the old policy it is PPO's gradient, fading as r leaves 1.
    Always aggregated "seq-mean-token-mean" (the paper's objective, and verl's), whatever loss_agg_mode says.
    """
    tau = torch.where(advantages > 0, torch.as_tensor(config.tau_pos, dtype=advantages.dtype, device=advantages.device),
                      torch.as_tensor(config.tau_neg, dtype=advantages.dtype, device=advantages.device))
    log_ratio = _log_ratio(log_prob, old_log_prob)
    gates = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    pg_losses = -gates * advantages
    metrics = {
        "actor/pg_clipfrac": torch.zeros((), device=log_prob.device),
        "actor/ppo_kl": _kl_metric(log_ratio, response_mask),
        "actor/pg_clipfrac_lower": torch.zeros((), device=log_prob.device),
    }
    return _aggregate(pg_losses, response_mask, "seq-mean-token-mean", config, rollout_is_weights), metrics


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode: str = "token-mean", config: Any = None,
                                 rollout_is_weights: torch.Tensor | None = None):
    """GMPO (arXiv 2507.20673): per sequence -A_seq * exp(mean over its tokens of the clipped log ratio), the
    geometric mean of the token ratios, which one outlier token cannot blow up as it does an arithmetic mean.

    Each token's log ratio is clipped to [-eps_low, eps_high] on the side its advantage pushes (sign-aware, as
    PPO's min); A_seq is the sequence's mean token advantage, IS weights enter as their per-sequence geometric
    mean. The sequence losses are averaged over the sequences of the global batch (`loss_agg_mode` is not
    used: the loss is per sequence); verl averages over the micro-batch's rows instead, which makes the
    gradient depend on the micro-batching. Metrics pg_clipfrac / pg_clipfrac_lower: clipped tokens with
    A > 0 / A < 0.
    """
    eps_low, eps_high = _clip_bounds(config, "geo_mean")
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -eps_low, eps_high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    mask = response_mask.to(log_ratio.dtype)
    lengths = mask.sum(dim=-1).clamp(min=1.0)
    seq_ratio = torch.exp((clipped_log_ratio * mask).sum(dim=-1) / lengths)
    seq_advantage = (advantages * mask).sum(dim=-1) / lengths
    seq_losses = -seq_advantage * seq_ratio
    if rollout_is_weights is not None:
        seq_losses = seq_losses * torch.exp((torch.log(rollout_is_weights + 1e-10) * mask).sum(dim=-1) / lengths)
    has_token = (mask.sum(dim=-1, keepdim=True) > 0).to(mask.dtype)
    pg_loss = agg_loss(seq_losses.unsqueeze(-1), has_token, "seq-mean-token-sum", **global_batch_info(config))
    clipped = log_ratio != clamped
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped & (advantages > 0)).float(), response_mask).detach(),
        "actor/ppo_kl": _kl_metric(log_ratio, response_mask),
        "actor/pg_clipfrac_lower": masked_mean((clipped & (advantages < 0)).float(), response_mask).detach(),
    }
    return pg_loss, metrics


@register_policy_loss("dro")
def compute_policy_loss_dro(old_log_prob, log_prob, advantages, response_mask,
                            loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_is_weights: torch.Tensor | None = None):
    """Direct reward optimisation: -(A log pi - beta / 2 * (log pi - log pi_old)^2), the policy gradient held near
    the old policy by a quadratic penalty instead of a clip; beta = policy_loss.dro_beta (> 0)."""
    beta = config.policy_loss.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 with loss_mode='dro', got {beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(advantages * log_prob - 0.5 * beta * log_ratio.square())
    metrics = {"actor/ppo_kl": _kl_metric(log_ratio, response_mask)}
    return _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights), metrics


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(old_log_prob, log_prob, advantages, response_mask,
                                    loss_agg_mode: str = "token-mean", config: Any = None,
                                    rollout_is_weights: torch.Tensor | None = None):
    """verl's bypass mode: the rollout's log-probs stand in for old_log_prob, and the rollout correction is
    computed here, against the current policy, from `config.policy_loss.rollout_correction`.

    Its rejection removes tokens from the mask; then loss_type "ppo_clip" (default) is the vanilla loss on
    that mask (its ratio already is pi / pi_rollout, so no IS weight is applied on top), and "reinforce" is
    -w * A * log pi with the detached truncated IS weights w (none without rollout_is). The
    `rollout_is_weights` argument is ignored: the weights are this loss's own. Metrics: the loss's and the
    correction's (rollout_corr/...).
    """
    settings = config.policy_loss.get("rollout_correction") if config is not None else None
    if settings is None:
        raise ValueError("loss_mode='bypass_mode' needs actor.policy_loss.rollout_correction (verl's bypass settings)")
    loss_type = settings.get("loss_type", "ppo_clip")
    if loss_type not in ("ppo_clip", "reinforce"):
        raise ValueError(f"policy_loss.rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', "
                         f"got {loss_type!r}")
    with torch.no_grad():
        correction = compute_rollout_correction_and_rejection_mask(
            log_prob, old_log_prob, response_mask, rollout_is=settings.get("rollout_is"),
            rollout_is_threshold=settings.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=settings.get("rollout_is_batch_normalize", False),
            rollout_rs=settings.get("rollout_rs"), rollout_rs_threshold=settings.get("rollout_rs_threshold"))
    kept_mask = correction.response_mask
    if loss_type == "ppo_clip":
        pg_loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, kept_mask, loss_agg_mode,
                                                       config)
    else:
        pg_loss, metrics = compute_policy_loss_reinforce(old_log_prob, log_prob, advantages, kept_mask, loss_agg_mode,
                                                         config, correction.rollout_is_weights)
    return pg_loss, {**metrics, **correction.metrics}


def compute_policy_loss_reinforce(rollout_log_prob, log_prob, advantages, response_mask,
                                  loss_agg_mode: str = "seq-mean-token-sum", config: Any = None,
                                  rollout_is_weights: torch.Tensor | None = None):
    """REINFORCE, -w * A * log pi with detached IS weights w (none: 1), as verl's of the same name; its
    metric ppo_kl is the mean of log(pi_rollout / pi). Not a registered loss: bypass_mode's "reinforce"."""
    pg_loss = _aggregate(-advantages * log_prob, response_mask, loss_agg_mode, config, rollout_is_weights)
    return pg_loss, {"actor/ppo_kl": _kl_metric(log_prob - rollout_log_prob, response_mask)}
