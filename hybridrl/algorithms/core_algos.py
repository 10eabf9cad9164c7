"""The algorithm core: advantage estimators (by name), and the one import point for all PPO-family math.

This module holds the advantage estimators, their registry and `compute_advantage`, the controller
step that runs the configured estimator over a batch. The losses live in `losses.py` and
`alternative_losses.py`, the KL pieces in `kl.py`; all are re-exported here so verl users keep writing
`from hybridrl.algorithms.core_algos import compute_policy_loss_vanilla, kl_penalty, ...`. verl's path,
`hybridrl.compat.verl.trainer.ppo.core_algos`, is this very module object (an alias in sys.modules),
so rebinding a registry there, as verl's tests do, rebinds it here.

Estimators take (batch, response_length) tensors and return `(advantages, returns)` of that shape,
zero outside `response_mask`. Outcome estimators (grpo, rloo, ...) use the sequence score
token_level_rewards.sum(-1) and group the samples of one prompt by `index`, a numpy array of prompt
uids. A user adds an estimator with `@register_adv_est("name")` in their own module and selects it
with `algorithm.adv_estimator=name`. Pure torch: no I/O, no distributed code.
"""
from __future__ import annotations

import inspect
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from hybridrl.algorithms.alternative_losses import (compute_policy_loss_bypass_mode, compute_policy_loss_cispo,
                                                    compute_policy_loss_dppo_kl, compute_policy_loss_dppo_tv,
                                                    compute_policy_loss_dro, compute_policy_loss_geo_mean,
                                                    compute_policy_loss_reinforce, compute_policy_loss_sapo)
from hybridrl.algorithms.kl import (AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller,
                                     kl_penalty, kl_penalty_forward)
from hybridrl.algorithms.losses import (POLICY_LOSS_REGISTRY, agg_loss, compute_entropy_loss,
                                         compute_policy_loss_clip_cov, compute_policy_loss_gpg,
                                         compute_policy_loss_gspo, compute_policy_loss_kl_cov,
                                         compute_policy_loss_vanilla, compute_value_loss, get_policy_loss_fn,
                                         global_batch_info, register_policy_loss)
from hybridrl.algorithms.token_baseline import path_variance, token_baselines
from hybridrl.algorithms.torch_functional import masked_whiten

if TYPE_CHECKING:
    from hybridrl.protocol import DataProto

__all__ = [
    # advantage estimators (this module)
    "AdvantageEstimator", "ADV_ESTIMATOR_REGISTRY", "register_adv_est", "get_adv_estimator_fn", "compute_advantage",
    "compute_gae_advantage_return", "compute_grpo_outcome_advantage", "compute_grpo_passk_outcome_advantage",
    "compute_rloo_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_remax_outcome_advantage",
    "compute_opo_outcome_advantage", "compute_grpo_vectorized_outcome_advantage", "compute_gdpo_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage", "compute_gpg_outcome_advantage",
    "compute_optimal_token_baseline_advantage", "compute_multi_turn_optimal_token_baseline_advantage",
    # losses (losses.py)
    "agg_loss", "global_batch_info", "POLICY_LOSS_REGISTRY", "register_policy_loss", "get_policy_loss_fn", "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo", "compute_policy_loss_gpg", "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov", "compute_value_loss", "compute_entropy_loss",
    # losses (alternative_losses.py)
    "compute_policy_loss_cispo", "compute_policy_loss_dppo_tv", "compute_policy_loss_dppo_kl",
    "compute_policy_loss_sapo", "compute_policy_loss_geo_mean", "compute_policy_loss_dro",
    "compute_policy_loss_bypass_mode", "compute_policy_loss_reinforce",
    # KL (kl.py)
    "kl_penalty", "kl_penalty_forward", "FixedKLController", "AdaptiveKLController", "get_kl_controller",
    "apply_kl_penalty",
]


class AdvantageEstimator(str, Enum):
    """Names of the built-in estimators (`algorithm.adv_estimator`)."""

    GAE = "gae"
    GRPO = "grpo"
    GRPO_PASSK = "grpo_passk"
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    OPO = "opo"
    GPG = "gpg"
    RLOO_VECTORIZED = "rloo_vectorized"
    GRPO_VECTORIZED = "grpo_vectorized"
    OPTIMAL_TOKEN_BASELINE = "optimal_token_baseline"
    TIR_OPTIMAL_TOKEN_BASELINE = "tir_optimal_token_baseline"
    GDPO = "gdpo"


AdvEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATOR_REGISTRY: dict[str, AdvEstimatorFn] = {}


def _estimator_name(name: str | Enum) -> str:
    """The registry key of `name`: an enum member (ours or a user's, as verl allows) stands for its value."""
    return name.value if isinstance(name, Enum) else name


def register_adv_est(name: str | Enum) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator; registering another function under a taken name is an error.

    The registry is read through this module's global at each call (never bound at import), so code that
    rebinds `core_algos.ADV_ESTIMATOR_REGISTRY`, as verl's tests do, registers into and looks up the new dict.
    """
    key = _estimator_name(name)

    def decorator(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {key!r} is already registered to "
                             f"{existing.__module__}.{existing.__qualname__}; pick another name")
        ADV_ESTIMATOR_REGISTRY[key] = fn
        return fn
    return decorator


def get_adv_estimator_fn(name: str | Enum) -> AdvEstimatorFn:
    """The estimator registered under `name`."""
    key = _estimator_name(name)
    if key not in ADV_ESTIMATOR_REGISTRY:
        # The message starts with verl's words, which verl users' code and verl's tests match on.
        raise ValueError(f"Unknown advantage estimator simply: {key}; registered: {sorted(ADV_ESTIMATOR_REGISTRY)}")
    return ADV_ESTIMATOR_REGISTRY[key]


def _rows_by_group(index: np.ndarray, batch_size: int) -> list[list[int]]:
    """Row numbers of each group of equal uids in `index`, groups in order of first appearance.

    The uids are compared as python values (`tolist`), so a tensor or numpy array of ids groups by
    value, not by the identity of its element objects.
    """
    uids = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(uids) != batch_size:
        raise ValueError(f"index (prompt uids) has {len(uids)} entries but the batch has {batch_size} rows")
    groups: dict[Any, list[int]] = {}
    for row, uid in enumerate(uids):
        groups.setdefault(uid, []).append(row)
    return list(groups.values())


def _group_ids(index: np.ndarray, batch_size: int, device: torch.device) -> torch.Tensor:
    """Each row's group number (0, 1, ... in order of first appearance), for the vectorized estimators."""
    group_of_row = torch.empty(batch_size, dtype=torch.long)
    for group, rows in enumerate(_rows_by_group(index, batch_size)):
        group_of_row[rows] = group
    return group_of_row.to(device)


def _grpo_scalars(scores: torch.Tensor, index: np.ndarray, epsilon: float,
                  norm_adv_by_std_in_grpo: bool) -> torch.Tensor:
    """Per sample: (score - group mean) [/ (group std + epsilon)]; a group of one has mean 0 and std 1."""
    scalars = torch.zeros_like(scores)
    for rows in _rows_by_group(index, len(scores)):
        group = scores[rows]
        mean, std = (group.mean(), group.std()) if len(rows) > 1 else (0.0, 1.0)
        scalars[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
    return scalars


@register_adv_est(AdvantageEstimator.GAE)
@torch.no_grad()
def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """Generalised advantage estimation; advantages whitened over the response tokens, returns = raw A + V.

    Masked-out tokens inside a response (e.g. tool output in a multi-turn rollout) are skipped:
    they neither add a TD error nor discount, so the recursion links the surrounding model tokens.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        td_error = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = td_error + gamma * lam * next_advantage
        next_value = torch.where(mask[:, t] > 0, values[:, t], next_value)
        next_advantage = torch.where(mask[:, t] > 0, advantage_t, next_advantage)
        advantages[:, t] = next_advantage
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask) * mask, returns


@register_adv_est(AdvantageEstimator.GRPO)
@torch.no_grad()
def compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None):
    """GRPO: (score - group mean) / (group std + epsilon), on every response token.

    std is the unbiased sample std; a group of one has mean 0 and std 1. With
    norm_adv_by_std_in_grpo=False the division is dropped (Dr.GRPO). `config` (the algorithm config)
    is accepted for verl's signature; the arguments carry all this estimator reads.
    """
    scores = token_level_rewards.sum(dim=-1)
    advantages = _grpo_scalars(scores, index, epsilon, norm_adv_by_std_in_grpo).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO_VECTORIZED)
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                              norm_adv_by_std_in_grpo=True, config=None):
    """GRPO with the group statistics gathered by scatter-adds instead of a loop over groups (large batches).

    The same numbers as `grpo`: the variance is summed from deviations about the group mean (two passes),
    not from sum(x^2) - sum(x)^2 / n, which cancels catastrophically when a group's scores nearly agree.
    """
    scores = token_level_rewards.sum(dim=-1)
    group = _group_ids(index, len(scores), scores.device)
    counts = torch.bincount(group).to(scores.dtype)
    mean = torch.zeros_like(counts).index_add_(0, group, scores) / counts
    squared_deviations = torch.zeros_like(counts).index_add_(0, group, (scores - mean[group]).square())
    std = (squared_deviations / (counts - 1).clamp(min=1)).sqrt()
    singleton = counts == 1
    mean, std = mean.masked_fill(singleton, 0.0), std.masked_fill(singleton, 1.0)
    centred = scores - mean[group]
    scalars = centred / (std[group] + epsilon) if norm_adv_by_std_in_grpo else centred
    advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GDPO)
@torch.no_grad()
def compute_gdpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                   norm_adv_by_std_in_grpo=True, config=None, non_tensor_batch=None, batch=None,
                                   **kwargs):
    """GDPO (arXiv 2601.05242): GRPO-normalise each reward component within its group, then sum them with
    weights and whiten over the batch's response tokens, so a large component cannot drown a small one.

    The components are the per-sample scores under `config.gdpo_reward_keys` in `non_tensor_batch` (what the
    scorer returns beside its score), weighted by `config.gdpo_reward_weights` (null: all 1). Without a config
    or a non-tensor batch the one component is the sequence score. `batch` is accepted for verl's signature.
    """
    keys = config.get("gdpo_reward_keys") if config is not None and non_tensor_batch is not None else None
    if config is not None and non_tensor_batch is not None and not keys:
        raise ValueError("advantage estimator 'gdpo' needs algorithm.gdpo_reward_keys: the reward components "
                         "(keys of the scorer's returned dict) to normalise one by one")
    components = [token_level_rewards.sum(dim=-1)] if not keys else [
        _reward_component(non_tensor_batch, key, token_level_rewards) for key in keys]
    weights = (config.get("gdpo_reward_weights") if keys else None) or [1.0] * len(components)
    combined = sum(weight * _grpo_scalars(scores, index, epsilon, norm_adv_by_std_in_grpo)
                   for weight, scores in zip(weights, components))
    mask = response_mask.to(token_level_rewards.dtype)
    advantages = masked_whiten(combined.unsqueeze(-1) * mask, mask) * mask
    return advantages, advantages


def _reward_component(non_tensor_batch: dict, key: str, like: torch.Tensor) -> torch.Tensor:
    """The per-sample values of reward component `key` as a (batch,) tensor of `like`'s dtype and device."""
    if key not in non_tensor_batch:
        raise ValueError(f"algorithm.gdpo_reward_keys names {key!r}, which the batch lacks (its non-tensor keys: "
                         f"{sorted(non_tensor_batch)}); the scorer must return a dict holding {key!r}")
    values = list(non_tensor_batch[key])
    missing = [row for row, value in enumerate(values) if value is None]
    if missing:
        raise ValueError(f"reward component {key!r} is None (the scorer gave no value) in rows {missing}")
    return torch.tensor(values, dtype=like.dtype, device=like.device)


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                         norm_adv_by_std_in_grpo=True, config=None, **kwargs):
    """Pass@k GRPO: only the best sample of a group is credited, by its margin over the runner-up.

    advantage(best) = (max - second max) [/ (group std + epsilon)]; all others get 0. Needs groups of >= 2.
    Given a `config`, its norm_adv_by_std_in_grpo decides, as in verl, whose callers pass only the config
    (compute_advantage passes the same value both ways).
    """
    if config is not None:
        norm_adv_by_std_in_grpo = config.get("norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    for rows in _rows_by_group(index, len(scores)):
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per prompt; uid {index[rows[0]]!r} has 1")
        group = scores[rows]
        top2 = torch.topk(group, 2)
        margin = top2.values[0] - top2.values[1]
        if norm_adv_by_std_in_grpo:
            margin = margin / (group.std() + epsilon)
        advantages[rows[top2.indices[0].item()]] = margin
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO)
@torch.no_grad()
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """RLOO: score minus the mean score of the other samples of the prompt; a group of one keeps its score.

    `epsilon` is accepted for verl's signature and unused.
    """
    scores = token_level_rewards.sum(dim=-1)
    advantages = scores.clone()
    for rows in _rows_by_group(index, len(scores)):
        n = len(rows)
        if n > 1:
            group = scores[rows]
            advantages[rows] = (group - group.mean()) * n / (n - 1)
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.RLOO_VECTORIZED)
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None,
                                              **kwargs):
    """RLOO by scatter-adds: (n * score - group sum) / (n - 1), the score minus the others' mean.

    Unlike the loop `rloo`, a group of one gets 0 (as verl's rloo_vectorized): it has no other sample to
    compare with.
    """
    scores = token_level_rewards.sum(dim=-1)
    group = _group_ids(index, len(scores), scores.device)
    counts = torch.bincount(group).to(scores.dtype)[group]
    group_sums = torch.zeros(int(group.max()) + 1, dtype=scores.dtype, device=scores.device).index_add_(
        0, group, scores)[group]
    scalars = torch.where(counts > 1, (counts * scores - group_sums) / (counts - 1).clamp(min=1), 0.0)
    advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GPG)
@torch.no_grad()
def compute_gpg_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, f_norm=1.0, alpha=1.0,
                                  config=None, **kwargs):
    """GPG (Chu et al., 2025): alpha * (score - group mean) / f_norm, with alpha = batch size / number of
    samples whose score is not 0, which scales the gradient back up when most samples score 0.

    A group of one has mean 0. alpha is always computed from the batch, as in verl, whose signature also
    takes it as an argument; `epsilon` is accepted for that signature and unused.
    """
    scores = token_level_rewards.sum(dim=-1)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    centred = scores.clone()
    for rows in _rows_by_group(index, len(scores)):
        if len(rows) > 1:
            centred[rows] = scores[rows] - scores[rows].mean()
    advantages = (alpha * centred / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, config=None, gamma=None,
                                                  **kwargs):
    """REINFORCE++: discounted return-to-go per token, whitened over the batch's response tokens.

    Masked-out tokens are skipped by the discounting, as in GAE. The discount is `gamma`, or, when it is
    not given (verl's callers pass only the config), `config.gamma`.
    """
    if gamma is None:
        if config is None:
            raise ValueError("reinforce_plus_plus needs the discount: pass gamma= or config= (algorithm.gamma)")
        gamma = config.gamma
    mask = response_mask.to(token_level_rewards.dtype)
    running_return = torch.zeros_like(token_level_rewards[:, 0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        return_t = token_level_rewards[:, t] + gamma * running_return
        running_return = torch.where(mask[:, t] > 0, return_t, running_return)
        returns[:, t] = return_t * mask[:, t]
    return masked_whiten(returns, mask) * mask, returns


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                                           config=None, **kwargs):
    """REINFORCE++ with a group baseline: (score - group mean) on every token, then whitened over the batch.

    A group of one has baseline 0. `epsilon` is accepted for verl's signature and unused.
    """
    scores = token_level_rewards.sum(dim=-1)
    centred = scores.clone()
    for rows in _rows_by_group(index, len(scores)):
        if len(rows) > 1:
            centred[rows] = scores[rows] - scores[rows].mean()
    mask = response_mask.to(scores.dtype)
    advantages = masked_whiten(centred.unsqueeze(-1) * mask, mask) * mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.REMAX)
@torch.no_grad()
def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask, config=None, **kwargs):
    """ReMax: return-to-go (undiscounted) minus the greedy rollout's reward `reward_baselines` (batch,)."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _returns_to_go(token_level_rewards, mask) * mask
    advantages = returns - reward_baselines.unsqueeze(-1) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.OPO)
@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """OPO: score minus the length-weighted mean score of its group, sum(len * score) / sum(len).

    A group of one has baseline 0. `epsilon` is accepted for verl's signature and unused.
    """
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.to(scores.dtype).sum(dim=-1)
    advantages = scores.clone()
    for rows in _rows_by_group(index, len(scores)):
        if len(rows) > 1:
            baseline = (lengths[rows] * scores[rows]).sum() / lengths[rows].sum().clamp(min=1e-8)
            advantages[rows] = scores[rows] - baseline
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.OPTIMAL_TOKEN_BASELINE)
@torch.no_grad()
def compute_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                             rollout_is_weights=None, handle_zero_tail=True, epsilon=1e-8,
                                             **kwargs):
    """Optimal token baseline (OTB): a baseline per prompt group and per position t instead of one per group,
    the variance-minimising B_t = sum_i G_it W_it / sum_i W_it over the group's samples that reach t.

    G_it is sample i's return-to-go; W_it = sum_{j<=t} w_ij accumulates w = 1 - 2 pi + sum_v pi_v^2, the squared
    norm of the softmax score function at the sampled token (pi = exp(old_log_probs), sum_v pi_v^2 =
    `sum_pi_squared`, both per token), times the squared rollout IS weight when given: a path that has been
    uncertain so far weighs more. A group of one gets no baseline. With handle_zero_tail, where one sample is
    longer than all others of its group, its positions from the runner-up's length on get baseline 0 (there
    the baseline would be its own return). Returns (advantages, returns-to-go).
    """
    returns = _returns_to_go(token_level_rewards, response_mask)
    path_weights = path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, response_mask)
    groups = _rows_by_group(index, len(returns))
    baselines = token_baselines(returns, path_weights, response_mask, groups, handle_zero_tail, epsilon)
    return (returns - baselines) * response_mask, returns


@register_adv_est(AdvantageEstimator.TIR_OPTIMAL_TOKEN_BASELINE)
@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(token_level_rewards, response_mask, index, old_log_probs,
                                                        sum_pi_squared, rollout_is_weights=None,
                                                        handle_zero_tail=True, epsilon=1e-8, **kwargs):
    """OTB for multi-turn (tool-integrated) responses: the same baseline, with position t counting only the
    response's own tokens, so tool output between turns does not misalign the samples of a group.

    Each row's masked-in tokens are packed to the left, the baselines computed there as in
    `optimal_token_baseline`, and the advantages put back at the tokens' places. A row with no response
    token joins no group.
    """
    returns = _returns_to_go(token_level_rewards, response_mask)
    path_weights = path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, response_mask)
    in_response = response_mask.bool()
    packed_order = torch.argsort((~in_response).to(torch.int8), dim=-1, stable=True)  # response tokens first
    packed_mask = response_mask.gather(-1, packed_order)
    groups = [[row for row in rows if in_response[row].any()] for rows in _rows_by_group(index, len(returns))]
    packed_baselines = token_baselines(returns.gather(-1, packed_order), path_weights.gather(-1, packed_order),
                                       packed_mask, groups, handle_zero_tail, epsilon)
    baselines = torch.zeros_like(returns).scatter(-1, packed_order, packed_baselines)
    return (returns - baselines) * response_mask, returns


def _returns_to_go(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Undiscounted sum of the response tokens' rewards from each position to the end."""
    return (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)


def compute_advantage(data: DataProto, adv_estimator: str, gamma: float = 1.0, lam: float = 1.0,
                      norm_adv_by_std_in_grpo: bool = True, config: Any = None) -> DataProto:
    """Run the estimator named `adv_estimator` on a batch; writes batch keys `advantages` and `returns`.

    The estimator gets, by parameter name, whichever of these it declares (all of them if it takes
    **kwargs): token_level_rewards, response_mask, values, reward_baselines, old_log_probs, sum_pi_squared,
    rollout_is_weights (batch keys, where the batch has them), index (non-tensor key `uid`), batch and
    non_tensor_batch (the whole batch, as verl hands GDPO its reward components), gamma, lam,
    norm_adv_by_std_in_grpo and config (the algorithm config). So a user estimator only names what it
    needs; a needed input that the batch lacks is an error naming it.
    """
    estimator = get_adv_estimator_fn(adv_estimator)
    inputs = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, "config": config,
              "batch": data.batch, "non_tensor_batch": data.non_tensor_batch}
    for key in ("token_level_rewards", "response_mask", "values", "reward_baselines", "old_log_probs",
                "sum_pi_squared", "rollout_is_weights"):
        if key in data.batch:
            inputs[key] = data.batch[key]
    if "uid" in data.non_tensor_batch:
        inputs["index"] = data.non_tensor_batch["uid"]
    advantages, returns = estimator(**_inputs_for(estimator, adv_estimator, inputs))
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


def _inputs_for(estimator: AdvEstimatorFn, name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The subset of `inputs` that `estimator`'s signature accepts; raises if a required one is missing."""
    parameters = inspect.signature(estimator).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return inputs
    missing = [p for p, spec in parameters.items() if spec.default is inspect.Parameter.empty and p not in inputs]
    if missing:
        where = {"index": "non-tensor batch key 'uid'",
                 "sum_pi_squared": "batch key 'sum_pi_squared' (sum of pi^2 over the vocabulary per token)"}
        raise ValueError(f"advantage estimator {name!r} needs {[where.get(p, f'batch key {p!r}') for p in missing]}, "
                         f"which the batch lacks (inputs available: {sorted(inputs)})")
    return {p: inputs[p] for p in parameters if p in inputs}
