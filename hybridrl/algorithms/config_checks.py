"""Config checks of the advantage estimators, policy losses and rollout correction, registered with
hybridrl.config.checks. core_algos (torch) is imported only when a config is checked, not when this module is."""
from __future__ import annotations

import inspect
from typing import Any

from hybridrl.config.checks import Values, register_check, register_registry, run_rule
from hybridrl.config.schema import PPOConfig


def _adv_estimator(name: str) -> Any:
    from hybridrl.algorithms.core_algos import get_adv_estimator_fn

    return get_adv_estimator_fn(name)


def _policy_loss(name: str) -> Any:
    from hybridrl.algorithms.core_algos import get_policy_loss_fn

    return get_policy_loss_fn(name)


register_registry("algorithm.adv_estimator", _adv_estimator)
register_registry("actor_rollout_ref.actor.policy_loss.loss_mode", _policy_loss)


@register_check()
def _critic_matches_estimator(values: Values, problems: list[str]) -> None:
    estimator = values("algorithm.adv_estimator")
    if estimator == "gae" and values("critic.enable") is False:
        problems.append("critic.enable: expected true or null when algorithm.adv_estimator='gae' "
                        "(GAE needs the critic's values), got False")


# Estimators whose baseline is the other responses to the same prompt (grpo_passk refuses groups of one itself).
GROUP_BASELINE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo")


@register_check("warnings")
def _group_baseline_needs_a_group(config: PPOConfig) -> list[str]:
    """rollout.n=1 leaves a group estimator without a baseline. verl's behaviour is kept (a group of one has
    baseline 0, so the advantage is the response's own score), and said before the start."""
    estimator, n = config.algorithm.adv_estimator, config.actor_rollout_ref.rollout.n
    if estimator not in GROUP_BASELINE_ESTIMATORS or n > 1:
        return []
    return [f"algorithm.adv_estimator={estimator!r} with actor_rollout_ref.rollout.n={n} has no baseline: its "
            f"baseline is the mean score of the other responses to the same prompt, and there are none, so each "
            f"response's advantage is its own score (as in verl); set actor_rollout_ref.rollout.n to 2 or more"]


ROLLOUT_CORRECTION = "algorithm.rollout_correction"


@register_check()
def _rollout_correction_settings(values: Values, problems: list[str]) -> None:
    """A correction that changes training needs the rollout's log-probs, rejection needs its threshold, the lower
    threshold lies below the upper, and IS weights need a policy loss that takes them."""
    def correction(key: str):
        return values(f"{ROLLOUT_CORRECTION}.{key}")

    uses = [f"{ROLLOUT_CORRECTION}.{key}={correction(key)!r}"
            for key in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold") if correction(key) is not None]
    if uses and not values("actor_rollout_ref.rollout.calculate_log_probs"):
        problems.append(f"actor_rollout_ref.rollout.calculate_log_probs: expected true with {', '.join(uses)} (the "
                        "correction compares the trainer's log-probs with the rollout's), got False")
    upper, lower = correction("rollout_rs_threshold"), correction("rollout_rs_threshold_lower")
    if correction("rollout_rs") is not None and upper is None:
        problems.append(f"{ROLLOUT_CORRECTION}.rollout_rs_threshold: expected an upper threshold > 0 with "
                        f"{ROLLOUT_CORRECTION}.rollout_rs={correction('rollout_rs')!r}, got None")
    if upper is not None and lower is not None and not lower < upper:
        problems.append(f"{ROLLOUT_CORRECTION}.rollout_rs_threshold_lower: expected less than "
                        f"rollout_rs_threshold={upper}, got {lower}")
    if correction("rollout_is") is not None:
        run_rule(_policy_loss_takes_is_weights, values, problems)


def _policy_loss_takes_is_weights(values: Values, problems: list[str]) -> None:
    from hybridrl.algorithms.core_algos import get_policy_loss_fn

    key = "actor_rollout_ref.actor.policy_loss.loss_mode"
    try:
        loss = get_policy_loss_fn(values(key))
    except ValueError:  # an unregistered name: validation's registry step reports it
        return
    if "rollout_is_weights" not in inspect.signature(loss).parameters:
        problems.append(f"{key}: expected a policy loss taking rollout_is_weights (verl's signature) with "
                        f"{ROLLOUT_CORRECTION}.rollout_is set, got {values(key)!r} (its parameters: "
                        f"{list(inspect.signature(loss).parameters)})")
