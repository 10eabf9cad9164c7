"""KL to the reference policy: per-token estimators, the coefficient controllers, the in-reward penalty.

Two places use a KL to the reference model (verl's config keys):
- in the reward (`algorithm.use_kl_in_reward`, estimator `algorithm.kl_penalty`, coefficient from
  `algorithm.kl_ctrl`): `apply_kl_penalty` turns token_level_scores into token_level_rewards;
- in the actor loss (`actor.use_kl_loss`, `actor.kl_loss_type`): the actor calls `kl_penalty` directly.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hybridrl.algorithms.torch_functional import masked_mean

if TYPE_CHECKING:
    from hybridrl.protocol import DataProto

KL_PENALTY_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")  # each also with a "+" suffix


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens.

    A "+" after the name (k3+, low_var_kl+, ...) keeps that estimator's value but takes k2's gradient
    (straight-through): k1 and k3 estimate the KL without bias, but their gradients do not estimate its
    gradient, while k2's does.

    kl / k1          log pi - log pi_ref                      (unbiased, high variance, can be < 0)
    abs              |log pi - log pi_ref|
    mse / k2         0.5 (log pi - log pi_ref)^2
    low_var_kl / k3  pi_ref/pi - log(pi_ref/pi) - 1, clamped to [-10, 10] (Schulman's k3: >= 0, low variance)
    full             needs the whole distributions, not two log-probs: not implemented
    """
    if kl_penalty.endswith("+"):
        value = kl_penalty_forward(logprob, ref_logprob, kl_penalty[:-1])
        k2 = 0.5 * (logprob - ref_logprob).square()
        return k2 - k2.detach() + value.detach()
    return kl_penalty_forward(logprob, ref_logprob, kl_penalty)


def kl_penalty_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """The estimator named `kl_penalty` (no "+"), value and gradient its own (verl's name)."""
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        log_ref_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        k3 = torch.exp(log_ref_ratio) - log_ref_ratio - 1.0
        return torch.clamp(k3, min=-10.0, max=10.0)
    if kl_penalty == "full":
        raise NotImplementedError("kl_penalty='full' needs the full vocabulary distributions of both models, "
                                  "which are not kept; use 'kl', 'abs', 'mse' or 'low_var_kl'")
    raise ValueError(f"kl_penalty={kl_penalty!r} is not one of {list(KL_PENALTY_TYPES)}")


# apply_kl_penalty's argument is also called kl_penalty (verl's name) and shadows the function there.
_kl_penalty_fn = kl_penalty


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """The coefficient moves the observed KL towards `target_kl` (Ziegler et al., 2019).

    value *= 1 + clip(current_kl / target_kl - 1, -0.2, 0.2) * n_steps / horizon
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adapt the coefficient after `n_steps` samples that showed `current_kl`."""
        proportional_error = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl_config: Any) -> FixedKLController | AdaptiveKLController:
    """The controller `algorithm.kl_ctrl` asks for: reads .type, .kl_coef, and for adaptive .target_kl, .horizon."""
    if kl_ctrl_config.type == "fixed":
        return FixedKLController(kl_coef=kl_ctrl_config.kl_coef)
    if kl_ctrl_config.type == "adaptive":
        if not kl_ctrl_config.horizon > 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, "
                             f"got {kl_ctrl_config.horizon}")
        return AdaptiveKLController(init_kl_coef=kl_ctrl_config.kl_coef, target_kl=kl_ctrl_config.target_kl,
                                    horizon=kl_ctrl_config.horizon)
    raise ValueError(f"algorithm.kl_ctrl.type={kl_ctrl_config.type!r} is not one of ['fixed', 'adaptive']")


def apply_kl_penalty(data: DataProto, kl_ctrl: FixedKLController | AdaptiveKLController,
                     kl_penalty: str = "kl") -> tuple[DataProto, dict[str, float]]:
    """token_level_rewards = token_level_scores - beta * KL(old_log_probs, ref_log_prob) on the response tokens.

    Reads batch keys token_level_scores, old_log_probs, ref_log_prob, response_mask; writes
    token_level_rewards. The batch's KL (mean over sequences of the per-sequence token mean) is fed
    to `kl_ctrl.update` with n_steps = batch size, and reported with the beta that was applied.
    """
    batch = data.batch
    response_mask = batch["response_mask"]
    token_kl = _kl_penalty_fn(batch["old_log_probs"], batch["ref_log_prob"], kl_penalty) * response_mask
    beta = kl_ctrl.value
    batch["token_level_rewards"] = batch["token_level_scores"] - beta * token_kl
    current_kl = masked_mean(token_kl, response_mask, axis=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=response_mask.shape[0])
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
