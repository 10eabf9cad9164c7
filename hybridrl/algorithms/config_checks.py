"""Config checks of the advantage estimators, policy losses and rollout correction, registered with
hybridrl.config.checks. core_algos (torch) is imported only when a config is checked, not when this module is."""
from __future__ import annotations

import inspect
from typing import Any

from hybridrl.config.checks import Values, register_check, register_registry, run_rule
from hybridrl.config.schema import PPOConfig

LOSS_MODE = "actor_rollout_ref.actor.policy_loss.loss_mode"


def _adv_estimator(name: str) -> Any:
    from hybridrl.algorithms.core_algos import get_adv_estimator_fn

    return get_adv_estimator_fn(name)


def _policy_loss(name: str) -> Any:
    from hybridrl.algorithms.core_algos import get_policy_loss_fn

    return get_policy_loss_fn(name)


register_registry("algorithm.adv_estimator", _adv_estimator)
register_registry(LOSS_MODE, _policy_loss)


@register_check()
def _critic_matches_estimator(values: Values, problems: list[str]) -> None:
    estimator = values("algorithm.adv_estimator")
    if estimator == "gae" and values("critic.enable") is False:
        problems.append("critic.enable: expected true or null when algorithm.adv_estimator='gae' "
                        "(GAE needs the critic's values), got False")


# verl's estimators that need an input the workers here do not produce: estimator -> why it is refused.
NEEDS_UNPRODUCED_INPUT = {
    name: ("needs the actor's per-token sum of pi^2 over the vocabulary (batch key sum_pi_squared, verl's "
           "actor.calculate_sum_pi_squared=true), which the actor here does not compute")
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline")}


@register_check()
def _estimator_inputs_exist(values: Values, problems: list[str]) -> None:
    """An estimator whose inputs no worker produces is refused before any worker starts, with the reason."""
    estimator = values("algorithm.adv_estimator")
    if estimator in NEEDS_UNPRODUCED_INPUT:
        problems.append(f"algorithm.adv_estimator: {estimator!r} {NEEDS_UNPRODUCED_INPUT[estimator]}; "
                        "choose another estimator")


@register_check()
def _gdpo_settings(values: Values, problems: list[str]) -> None:
    """GDPO needs its reward components named and one weight per component (the scorer's per-sample extras reach the
    batch as columns: data/sample.samples_to_batch)."""
    if values("algorithm.adv_estimator") != "gdpo":
        return
    keys, weights = values("algorithm.gdpo_reward_keys"), values("algorithm.gdpo_reward_weights")
    if not keys:
        problems.append("algorithm.gdpo_reward_keys: expected a non-empty list of the reward components (keys of the "
                        f"dict the scorer returns) with algorithm.adv_estimator='gdpo', got {keys!r}")
    elif weights is not None and len(weights) != len(keys):
        problems.append(f"algorithm.gdpo_reward_weights: expected one weight per gdpo_reward_keys entry "
                        f"({len(keys)}: {list(keys)}), got {len(weights)}: {list(weights)}")


@register_check()
def _policy_loss_settings(values: Values, problems: list[str]) -> None:
    """dro needs its penalty weight; bypass_mode needs the trainer's bypass, which is not implemented."""
    loss_mode = values(LOSS_MODE)
    if loss_mode == "dro" and values("actor_rollout_ref.actor.policy_loss.dro_beta") is None:
        problems.append("actor_rollout_ref.actor.policy_loss.dro_beta: expected a value > 0 with "
                        "loss_mode='dro' (the weight of its quadratic log-ratio penalty), got None")
    if loss_mode == "bypass_mode":
        problems.append(f"{LOSS_MODE}: 'bypass_mode' is verl's loss for its bypass mode, where the rollout's "
                        "log-probs replace old_log_probs; the trainer here always recomputes old_log_probs "
                        "(algorithm.rollout_correction.bypass_mode is only false): use algorithm.rollout_correction "
                        "with loss_mode='vanilla' for the same correction")


# Estimators whose baseline is the other responses to the same prompt (grpo_passk refuses groups of one itself).
GROUP_BASELINE_ESTIMATORS = ("grpo", "grpo_vectorized", "gdpo", "rloo", "rloo_vectorized", "gpg",
                             "reinforce_plus_plus_baseline", "opo")


@register_check("warnings")
def _group_baseline_needs_a_group(config: PPOConfig) -> list[str]:
    """rollout.n=1 leaves a group estimator without a baseline. verl's behaviour is kept (a group of one has
    baseline 0: the advantage is the response's own score, or 0 with rloo_vectorized), and said before the start."""
    estimator, n = config.algorithm.adv_estimator, config.actor_rollout_ref.rollout.n
    if estimator not in GROUP_BASELINE_ESTIMATORS or n > 1:
        return []
    return [f"algorithm.adv_estimator={estimator!r} with actor_rollout_ref.rollout.n={n} has no baseline: it "
            f"compares each response with the other responses to the same prompt, and there are none (verl runs it "
            f"so too); set actor_rollout_ref.rollout.n to 2 or more"]


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

    key = LOSS_MODE
    try:
        loss = get_policy_loss_fn(values(key))
    except ValueError:  # an unregistered name: validation's registry step reports it
        return
    if "rollout_is_weights" not in inspect.signature(loss).parameters:
        problems.append(f"{key}: expected a policy loss taking rollout_is_weights (verl's signature) with "
                        f"{ROLLOUT_CORRECTION}.rollout_is set, got {values(key)!r} (its parameters: "
                        f"{list(inspect.signature(loss).parameters)})")
