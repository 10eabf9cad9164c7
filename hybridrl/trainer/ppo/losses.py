"""What the actor and the critic minimise: loss aggregation, policy losses (by name), value and entropy losses.

All tensors are shaped (batch, response_length) unless said otherwise; `response_mask` is 1 on the
response tokens that count. Pure torch: no I/O, no distributed code.

Policy losses are looked up by name (`actor_rollout_ref.actor.policy_loss.loss_mode` in verl's config)
through `get_policy_loss_fn`; a user adds one with `@register_policy_loss("name")` in their own module.
Every policy loss has the signature

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None)
        -> (pg_loss: 0-dim Tensor, metrics: dict[str, float | 0-dim Tensor])

The built-in losses return metrics as detached 0-dim tensors (no device sync here; the caller turns
them into floats when it logs). `config` is any object with these attributes (the actor config):

    clip_ratio          PPO clip epsilon, used where the next two are None       (vanilla, gspo, clip_cov)
    clip_ratio_low      lower epsilon: ratio is clipped at 1 - clip_ratio_low     (vanilla, gspo, clip_cov)
    clip_ratio_high     upper epsilon: ratio is clipped at 1 + clip_ratio_high    (vanilla, gspo, clip_cov)
    clip_ratio_c        dual-clip bound for negative advantages, must be > 1      (vanilla)
    policy_loss.clip_cov_ratio, .clip_cov_lb, .clip_cov_ub                        (clip_cov)
    policy_loss.kl_cov_ratio, .ppo_kl_coef                                        (kl_cov)
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from hybridrl.utils.torch_functional import clip_by_value, entropy_from_logits, masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Reduce a (batch, length) loss matrix to a scalar.

    token-mean               mean over all masked tokens of the batch (long answers weigh more)
    seq-mean-token-sum       per-sequence sum, then mean over sequences
    seq-mean-token-mean      per-sequence mean, then mean over sequences (fully-masked rows are left out)
    seq-mean-token-sum-norm  sum over all tokens / response_length, a constant divisor (Dr.GRPO)
    """
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return masked_mean(loss_mat, mask)
    seq_sums = (loss_mat * mask).sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-sum":
        return seq_sums.mean()
    if loss_agg_mode == "seq-mean-token-mean":
        tokens_per_seq = mask.sum(dim=-1)
        has_tokens = (tokens_per_seq > 0).to(loss_mat.dtype)
        return masked_mean(seq_sums / tokens_per_seq.clamp(min=1e-8), has_tokens)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / loss_mask.shape[-1]
    raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under `name`; registering another function under a taken name is an error."""
    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        existing = POLICY_LOSS_REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(f"policy loss {name!r} is already registered to "
                             f"{existing.__module__}.{existing.__qualname__}; pick another name")
        POLICY_LOSS_REGISTRY[name] = fn
        return fn
    return decorator


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered under `name`."""
    if name not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"unknown policy loss {name!r}; registered: {sorted(POLICY_LOSS_REGISTRY)}")
    return POLICY_LOSS_REGISTRY[name]


def _clip_bounds(config: Any, loss_name: str) -> tuple[float, float]:
    """(epsilon_low, epsilon_high) from the config; a None side falls back to clip_ratio."""
    if config is None:
        raise ValueError(f"policy loss {loss_name!r} needs a config with clip_ratio, clip_ratio_low, clip_ratio_high")
    low = config.clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
    high = config.clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
    return low, high


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) per token, clamped to [-20, 20] so exp() cannot overflow on a stale sample."""
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask,
                                loss_agg_mode: str = "token-mean", config: Any = None):
    """PPO clipped surrogate with asymmetric bounds (clip-higher) and dual clip.

    Per token: max(-A r, -A clip(r, 1-eps_low, 1+eps_high)); for A < 0 that is further capped at
    -A * clip_ratio_c, so a huge ratio on a bad token cannot blow the loss up (dual-clip PPO).
    Metrics: pg_clipfrac (tokens where clipping binds), ppo_kl (mean log(pi_old/pi)),
    pg_clipfrac_lower (negative-advantage tokens where the dual clip binds).
    """
    eps_low, eps_high = _clip_bounds(config, "vanilla")
    if not config.clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for the dual clip, got {config.clip_ratio_c}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    ppo_clipped = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * config.clip_ratio_c
    pg_losses = torch.where(advantages < 0, torch.minimum(ppo_clipped, dual_bound), ppo_clipped)
    dual_clipped = (ppo_clipped > dual_bound) & (advantages < 0)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
        "actor/pg_clipfrac_lower": masked_mean(dual_clipped.float(), response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode), metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask,
                             loss_agg_mode: str = "token-mean", config: Any = None):
    """GSPO: the clipped surrogate on a sequence-level ratio (Zheng et al., 2025).

    Every token of a sequence carries the same value s = exp(mean over the sequence of
    log(pi/pi_old)) but its gradient is its own token's (the "GSPO-token" form:
    log_prob - sg(log_prob) + sg(mean log ratio)). The paper's objective aggregates with
    loss_agg_mode="seq-mean-token-mean"; the configured mode is used as given.
    """
    eps_low, eps_high = _clip_bounds(config, "gspo")
    log_ratio = log_prob - old_log_prob
    mask = response_mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    token_log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(token_log_seq_ratio, max=10.0))
    unclipped = -advantages * seq_ratio
    clipped = -advantages * torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    pg_losses = torch.maximum(unclipped, clipped)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode), metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask,
                            loss_agg_mode: str = "token-mean", config: Any = None):
    """GPG: plain policy gradient -A * log pi, no ratio and no clip (Chu et al., 2025)."""
    pg_losses = -advantages * log_prob
    metrics = {"actor/ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
    return agg_loss(pg_losses, response_mask, loss_agg_mode), metrics


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode: str = "token-mean", config: Any = None):
    """Clip-Cov (Cui et al., 2025): drop the gradient of a few tokens whose advantage x log-prob covariance is high.

    Candidates are masked-in tokens not already clipped by PPO whose centred covariance
    (A - mean A)(log pi - mean log pi) lies in (clip_cov_lb, clip_cov_ub); max(1, int(clip_cov_ratio *
    #tokens)) of them, chosen at random (torch's global RNG), get loss 0. Other tokens use the PPO
    clipped surrogate. Metric pg_clipfrac is the fraction of tokens dropped this way.
    """
    eps_low, eps_high = _clip_bounds(config, "clip_cov")
    params = config.policy_loss
    if not params.clip_cov_ratio > 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0, got {params.clip_cov_ratio}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    with torch.no_grad():
        in_response = response_mask.bool()
        cov = (advantages - masked_mean(advantages, response_mask)) * (log_prob - masked_mean(log_prob, response_mask))
        candidates = in_response & ~(clipped > unclipped) & (cov > params.clip_cov_lb) & (cov < params.clip_cov_ub)
        candidate_positions = candidates.nonzero()
        n_dropped = min(max(int(params.clip_cov_ratio * in_response.sum().item()), 1), len(candidate_positions))
        chosen = candidate_positions[torch.randperm(len(candidate_positions), device=advantages.device)[:n_dropped]]
        keep = torch.ones_like(advantages)
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    pg_losses = torch.maximum(unclipped, clipped) * keep
    metrics = {
        "actor/pg_clipfrac": masked_mean((keep == 0).float(), response_mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode), metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask,
                               loss_agg_mode: str = "token-mean", config: Any = None):
    """KL-Cov (Cui et al., 2025): unclipped surrogate, plus a |log ratio| penalty on the highest-covariance tokens.

    The max(1, int(kl_cov_ratio * #tokens)) masked-in tokens with the largest centred covariance
    (A - mean A)(log pi - mean log pi) get ppo_kl_coef * |log(pi/pi_old)| added to -A r.
    Metric pg_clipfrac is the fraction of tokens penalised this way.
    """
    params = config.policy_loss
    if not params.kl_cov_ratio > 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0, got {params.kl_cov_ratio}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    pg_losses = -advantages * torch.exp(log_ratio)
    with torch.no_grad():
        in_response = response_mask.bool()
        valid_adv, valid_logp = advantages[in_response], log_prob[in_response]
        cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
        n_penalised = max(1, int(len(cov) * params.kl_cov_ratio)) if len(cov) else 0
        chosen = in_response.nonzero()[torch.topk(cov, n_penalised).indices]
        penalised = torch.zeros_like(advantages)
        penalised[chosen[:, 0], chosen[:, 1]] = 1.0
    pg_losses = pg_losses + penalised * params.ppo_kl_coef * log_ratio.abs()
    metrics = {
        "actor/pg_clipfrac": masked_mean(penalised, response_mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return agg_loss(pg_losses, response_mask, loss_agg_mode), metrics


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float,
                       loss_agg_mode: str = "token-mean") -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), and the clipped fraction."""
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = (vpreds - returns) ** 2
    clipped_error = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped_error, clipped_error), response_mask, loss_agg_mode)
    vf_clipfrac = masked_mean((clipped_error > unclipped_error).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor,
                         loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Aggregated entropy of the policy over the response tokens; logits are (batch, length, vocab)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
