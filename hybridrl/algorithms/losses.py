"""What the actor and the critic minimise: loss aggregation, policy losses (by name), value and entropy losses.

All tensors are shaped (batch, response_length) unless said otherwise; `response_mask` is 1 on the
response tokens that count. Pure torch: no I/O, no distributed code.

Policy losses are looked up by name (`actor_rollout_ref.actor.policy_loss.loss_mode` in verl's config)
through `get_policy_loss_fn`; a user adds one with `@register_policy_loss("name")` in their own module.
The losses that replace PPO's clipped surrogate (cispo, dppo_*, sapo, geo_mean, dro, bypass_mode) live in
`alternative_losses.py`.
Every policy loss has the signature

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
       rollout_is_weights=None) -> (pg_loss: 0-dim Tensor, metrics: dict[str, float | 0-dim Tensor])

`rollout_is_weights` (verl's argument): per-token importance weights of the rollout-training mismatch
correction (algorithm.rollout_correction, algorithms/rollout_correction.py); the built-in losses multiply
their per-token loss by them before aggregating (`apply_rollout_is_weights`). The actor passes the argument
only when the batch has weights, so a loss without it still works while the correction's IS is off.

and aggregates its per-token loss with
`agg_loss(loss_mat, response_mask, loss_agg_mode, **global_batch_info(config))` (verl writes
`**config.global_batch_info`, the same dict): inside the actor's update that normalises the
micro-batch by the counts of the whole global mini-batch, which is what keeps the gradient the same
for any data-parallel size and micro-batch size (see `agg_loss`). A loss that aggregates on its own
counts instead trains with a gradient that depends on how the batch was split.

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

from hybridrl.algorithms.rollout_correction import apply_rollout_is_weights
from hybridrl.algorithms.torch_functional import clip_by_value, entropy_from_logits, masked_mean

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
POLICY_LOSS_REGISTRY: dict[str, PolicyLossFn] = {}


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens: float | torch.Tensor | None = None,
             global_batch_size: float | torch.Tensor | None = None,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a (batch, length) loss matrix to a scalar, normalised over the whole global batch.

    token-mean               sum over the masked tokens / batch_num_tokens (long answers weigh more)
    token-sum                sum over the masked tokens, no normalisation (verl 0.9's mode)
    seq-mean-token-sum       per-sequence token sum, then mean over the sequences that have a token
    seq-mean-token-mean      per-sequence token mean, then mean over the sequences that have a token
    seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor (default: the padded response length): Dr. GRPO's
                             objective, the mean over the responses of their token sums over a constant (verl
                             since 0.7.1; verl 0.7.0 took no mean over the sequences, so its gradient grew with
                             the batch size)

    A fully-masked row (no response token) is left out of every mean: it has no loss to average.

    The same signature as verl's. Called on a whole batch with the defaults, every count is this
    batch's own. Called on one rank's micro-batch, `batch_num_tokens` (token-mean) or
    `global_batch_size` (the seq-mean modes: sequences with a token) is the count over the whole
    mini-batch on all data-parallel ranks, and `dp_size` the number of ranks: the result is then this
    micro-batch's share of the global loss times dp_size, so that summing it over micro-batches and
    letting FSDP average the gradients over the ranks gives exactly the gradient of the loss of the
    whole global mini-batch at once, whatever the data-parallel size or micro-batching. A global count
    of 0 (nothing to learn from) gives a loss of 0. seq-mean-token-sum-norm stays invariant as long as every
    micro-batch has the same padded width or loss_scale_factor is set (a constant divisor).
    """
    mask = loss_mask.bool()
    token_losses = torch.where(mask, loss_mat, torch.zeros_like(loss_mat))  # a NaN under padding stays out
    if loss_agg_mode == "token-mean":
        count = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return token_losses.sum() / _at_least_one(count) * dp_size
    if loss_agg_mode == "token-sum":  # a micro-batch's sum is its share of the global sum: only dp_size applies
        return token_losses.sum() * dp_size
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
    tokens_per_seq = mask.sum(dim=-1)
    seq_losses = token_losses.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = seq_losses / tokens_per_seq.clamp(min=1)
    count = (tokens_per_seq > 0).sum() if global_batch_size is None else global_batch_size
    seq_mean = seq_losses.sum() / _at_least_one(count) * dp_size  # an empty row's sum is 0: it adds nothing
    if loss_agg_mode == "seq-mean-token-sum-norm":  # token sums over a constant, not over each response's length
        return seq_mean / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return seq_mean


def _at_least_one(count: float | torch.Tensor) -> float | torch.Tensor:
    """A divisor for a count that may be 0 (then the sum it divides is 0 as well)."""
    return count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1)


def global_batch_info(config: Any) -> dict[str, Any]:
    """The keyword arguments of `agg_loss` that make a micro-batch's loss a share of the global loss.

    The actor sets `config.global_batch_info` (as verl does) for each mini-batch it updates on:
    dp_size, batch_num_tokens and global_batch_size over all data-parallel ranks. Outside an update
    (a loss called on a whole batch) there is none, and the loss aggregates over what it is given.
    """
    return getattr(config, "global_batch_info", None) or {}


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
                                loss_agg_mode: str = "token-mean", config: Any = None,
                                rollout_is_weights: torch.Tensor | None = None):
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
    pg_losses = apply_rollout_is_weights(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info(config)), metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask,
                             loss_agg_mode: str = "token-mean", config: Any = None,
                             rollout_is_weights: torch.Tensor | None = None):
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
    pg_losses = apply_rollout_is_weights(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info(config)), metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask,
                            loss_agg_mode: str = "token-mean", config: Any = None,
                            rollout_is_weights: torch.Tensor | None = None):
    """GPG: plain policy gradient -A * log pi, no ratio and no clip (Chu et al., 2025)."""
    pg_losses = -advantages * log_prob
    metrics = {"actor/ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
    pg_losses = apply_rollout_is_weights(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info(config)), metrics


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode: str = "token-mean", config: Any = None,
                                 rollout_is_weights: torch.Tensor | None = None):
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
    pg_losses = apply_rollout_is_weights(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info(config)), metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(old_log_prob, log_prob, advantages, response_mask,
                               loss_agg_mode: str = "token-mean", config: Any = None,
                               rollout_is_weights: torch.Tensor | None = None):
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
    pg_losses = apply_rollout_is_weights(pg_losses, rollout_is_weights)
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **global_batch_info(config)), metrics


def compute_value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float, loss_agg_mode: str = "token-mean",
                       dp_size: int = 1, batch_num_tokens: float | torch.Tensor | None = None,
                       global_batch_size: float | torch.Tensor | None = None,
                       loss_scale_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), and the clipped fraction.

    dp_size, batch_num_tokens, global_batch_size, loss_scale_factor: agg_loss's, for a micro-batch of a
    data-parallel update (the critic passes its global batch info; the defaults aggregate over the rows given).
    """
    vpred_clipped = clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = (vpreds - returns) ** 2
    clipped_error = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(unclipped_error, clipped_error), response_mask, loss_agg_mode,
                             dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size,
                             loss_scale_factor=loss_scale_factor)
    vf_clipfrac = masked_mean((clipped_error > unclipped_error).float(), response_mask)
    return vf_loss, vf_clipfrac


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor,
                         loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Aggregated entropy of the policy over the response tokens; logits are (batch, length, vocab)."""
    return agg_loss(entropy_from_logits(logits), response_mask, loss_agg_mode)
