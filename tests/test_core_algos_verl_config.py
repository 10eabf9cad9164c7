"""The algorithms' config checks for verl's 2026 estimators and losses: what each needs is asked for, and what this
trainer cannot feed is refused with the reason, before any worker starts."""
import pytest

from hybridrl.config import ConfigError, compose_config, validate_config


def problems_for(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config(overrides))
    return caught.value.problems


def test_verls_keys_compose_with_their_defaults_and_take_values():
    config = validate_config(compose_config([
        "actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta=0.1",
        "actor_rollout_ref.actor.tau_pos=2.0", "actor_rollout_ref.actor.kl_loss_type=k3+",
        "actor_rollout_ref.actor.loss_agg_mode=token-sum"]))
    actor = config.actor_rollout_ref.actor
    assert (actor.policy_loss.dro_beta, actor.tau_pos, actor.tau_neg) == (0.1, 2.0, 1.05)
    assert (actor.kl_loss_type, actor.loss_agg_mode) == ("k3+", "token-sum")
    assert (config.algorithm.gdpo_reward_keys, config.algorithm.gdpo_reward_weights) == (None, None)


def test_dro_needs_its_beta_and_bypass_mode_is_refused_with_the_reason():
    assert problems_for("actor_rollout_ref.actor.policy_loss.loss_mode=dro") == [
        "actor_rollout_ref.actor.policy_loss.dro_beta: expected a value > 0 with loss_mode='dro' (the weight of its "
        "quadratic log-ratio penalty), got None"]
    [problem] = problems_for("actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode")
    assert problem.startswith("actor_rollout_ref.actor.policy_loss.loss_mode: 'bypass_mode' is verl's loss for its "
                              "bypass mode, where the rollout's log-probs replace old_log_probs")


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_the_optimal_token_baselines_are_refused_for_their_missing_input(estimator):
    assert problems_for(f"algorithm.adv_estimator={estimator}") == [
        f"algorithm.adv_estimator: '{estimator}' needs the actor's per-token sum of pi^2 over the vocabulary (batch "
        "key sum_pi_squared, verl's actor.calculate_sum_pi_squared=true), which the actor here does not compute; "
        "choose another estimator"]


def test_gdpo_needs_its_components_and_one_weight_each_in_any_route():
    assert problems_for("algorithm.adv_estimator=gdpo") == [
        "algorithm.gdpo_reward_keys: expected a non-empty list of the reward components (keys of the dict the scorer "
        "returns) with algorithm.adv_estimator='gdpo', got None"]
    assert problems_for("algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,fmt]",
                        "algorithm.gdpo_reward_weights=[1.0]") == [
        "algorithm.gdpo_reward_weights: expected one weight per gdpo_reward_keys entry (2: ['acc', 'fmt']), got 1: "
        "[1.0]"]
    # the scorer's extras reach the batch as columns in every route (data/sample.samples_to_batch): the data flow too
    validate_config(compose_config(["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc]",
                                    "data_flow.enable=true", "actor_rollout_ref.rollout.mode=async",
                                    "data.return_raw_chat=true"]))
    validate_config(compose_config(["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,fmt]"]))
