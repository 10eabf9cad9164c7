"""The algorithm core: advantage estimators (by name), and the one import point for all PPO-family math.

This module holds the advantage estimators, their registry and `compute_advantage`, the controller
step that runs the configured estimator over a batch. The losses live in `losses.py` and the KL
pieces in `kl.py`; both are re-exported here so verl users keep writing
`from hybridrl.algorithms.core_algos import compute_policy_loss_vanilla, kl_penalty, ...`.

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

from hybridrl.algorithms.kl import (AdaptiveKLController, FixedKLController, apply_kl_penalty, get_kl_controller,
                                     kl_penalty)
from hybridrl.algorithms.losses import (POLICY_LOSS_REGISTRY, agg_loss, compute_entropy_loss,
                                         compute_policy_loss_clip_cov, compute_policy_loss_gpg,
                                         compute_policy_loss_gspo, compute_policy_loss_kl_cov,
                                         compute_policy_loss_vanilla, compute_value_loss, get_policy_loss_fn,
                                         global_batch_info, register_policy_loss)
from hybridrl.algorithms.torch_functional import masked_whiten

if TYPE_CHECKING:
    from hybridrl.protocol import DataProto

__all__ = [
    # advantage estimators (this module)
    "AdvantageEstimator", "ADV_ESTIMATOR_REGISTRY", "register_adv_est", "get_adv_estimator_fn", "compute_advantage",
    "compute_gae_advantage_return", "compute_grpo_outcome_advantage", "compute_grpo_passk_outcome_advantage",
    "compute_rloo_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
    "compute_reinforce_plus_plus_baseline_outcome_advantage", "compute_remax_outcome_advantage",
    "compute_opo_outcome_advantage",
    # losses (losses.py)
    "agg_loss", "global_batch_info", "POLICY_LOSS_REGISTRY", "register_policy_loss", "get_policy_loss_fn", "compute_policy_loss_vanilla",
    "compute_policy_loss_gspo", "compute_policy_loss_gpg", "compute_policy_loss_clip_cov",
    "compute_policy_loss_kl_cov", "compute_value_loss", "compute_entropy_loss",
    # KL (kl.py)
    "kl_penalty", "FixedKLController", "AdaptiveKLController", "get_kl_controller", "apply_kl_penalty",
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


AdvEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATOR_REGISTRY: dict[str, AdvEstimatorFn] = {}


def _estimator_name(name: str | AdvantageEstimator) -> str:
    return name.value if isinstance(name, AdvantageEstimator) else name


def register_adv_est(name: str | AdvantageEstimator) -> Callable[[AdvEstimatorFn], AdvEstimatorFn]:
    """Decorator registering an advantage estimator; registering another function under a taken name is an error."""
    key = _estimator_name(name)

    def decorator(fn: AdvEstimatorFn) -> AdvEstimatorFn:
        existing = ADV_ESTIMATOR_REGISTRY.get(key)
        if existing is not None and existing is not fn:
            raise ValueError(f"advantage estimator {key!r} is already registered to "
                             f"{existing.__module__}.{existing.__qualname__}; pick another name")
        ADV_ESTIMATOR_REGISTRY[key] = fn
        return fn
    return decorator


def get_adv_estimator_fn(name: str | AdvantageEstimator) -> AdvEstimatorFn:
    """The estimator registered under `name`."""
    key = _estimator_name(name)
    if key not in ADV_ESTIMATOR_REGISTRY:
        raise ValueError(f"unknown advantage estimator {key!r}; registered: {sorted(ADV_ESTIMATOR_REGISTRY)}")
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
                                   norm_adv_by_std_in_grpo=True):
    """GRPO: (score - group mean) / (group std + epsilon), on every response token.

    std is the unbiased sample std; a group of one has mean 0 and std 1. With
    norm_adv_by_std_in_grpo=False the division is dropped (Dr.GRPO).
    """
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    for rows in _rows_by_group(index, len(scores)):
        group = scores[rows]
        mean, std = (group.mean(), group.std()) if len(rows) > 1 else (0.0, 1.0)
        advantages[rows] = (group - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else group - mean
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est(AdvantageEstimator.GRPO_PASSK)
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6,
                                         norm_adv_by_std_in_grpo=True):
    """Pass@k GRPO: only the best sample of a group is credited, by its margin over the runner-up.

    advantage(best) = (max - second max) [/ (group std + epsilon)]; all others get 0. Needs groups of >= 2.
    """
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
def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
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


@register_adv_est(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, gamma):
    """REINFORCE++: discounted return-to-go per token, whitened over the batch's response tokens.

    Masked-out tokens are skipped by the discounting, as in GAE.
    """
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
def compute_reinforce_plus_plus_baseline_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
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
def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask):
    """ReMax: return-to-go (undiscounted) minus the greedy rollout's reward `reward_baselines` (batch,)."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    advantages = returns - reward_baselines.unsqueeze(-1) * mask
    return advantages, returns


@register_adv_est(AdvantageEstimator.OPO)
@torch.no_grad()
def compute_opo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
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


def compute_advantage(data: DataProto, adv_estimator: str, gamma: float = 1.0, lam: float = 1.0,
                      norm_adv_by_std_in_grpo: bool = True, config: Any = None) -> DataProto:
    """Run the estimator named `adv_estimator` on a batch; writes batch keys `advantages` and `returns`.

    The estimator gets, by parameter name, whichever of these it declares (all of them if it takes
    **kwargs): token_level_rewards, response_mask, values, reward_baselines (batch keys),
    index (non-tensor key `uid`), gamma, lam, norm_adv_by_std_in_grpo and config (the algorithm
    config). So a user estimator only names what it needs; a needed input that the batch lacks is
    an error naming it.
    """
    estimator = get_adv_estimator_fn(adv_estimator)
    inputs = {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo, "config": config}
    for key in ("token_level_rewards", "response_mask", "values", "reward_baselines"):
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
        where = {"index": "non-tensor batch key 'uid'"}
        raise ValueError(f"advantage estimator {name!r} needs {[where.get(p, f'batch key {p!r}') for p in missing]}, "
                         f"which the batch lacks (inputs available: {sorted(inputs)})")
    return {p: inputs[p] for p in parameters if p in inputs}
