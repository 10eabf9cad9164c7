"""The advantage estimators verl added in 2026 (grpo_vectorized, rloo_vectorized, gpg, gdpo, optimal_token_baseline,
tir_optimal_token_baseline) against numbers worked out by hand on small batches, verl's call forms, and the
registry's verl contract (enum names, rebinding the registry through verl's module path)."""
import math
from enum import Enum
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridrl.algorithms import core_algos
from hybridrl.protocol import DataProto

EPS = 1e-6  # the outcome estimators' default epsilon


def _outcome_batch(scores, length=2):
    """Each score on the last of `length` response tokens, all tokens in the response."""
    rewards = torch.zeros(len(scores), length, dtype=torch.float64)
    rewards[:, -1] = torch.tensor(scores, dtype=torch.float64)
    return rewards, torch.ones(len(scores), length, dtype=torch.float64)


def _per_row(advantages):
    """The one value each row carries on all its tokens (checked, then returned as a list)."""
    assert torch.all(advantages == advantages[:, :1]), advantages
    return advantages[:, 0].tolist()


# ---- group estimators ----

def test_grpo_vectorized_by_hand():
    # group a: scores 1, 0, 2 -> mean 1, unbiased std 1; group b: one sample -> mean 0, std 1
    rewards, mask = _outcome_batch([1.0, 0.0, 2.0, 5.0])
    index = np.array(["a", "a", "a", "b"], dtype=object)
    advantages, returns = core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, index)
    assert _per_row(advantages) == pytest.approx([0.0, -1 / (1 + EPS), 1 / (1 + EPS), 5 / (1 + EPS)], abs=1e-12)
    assert returns is advantages
    raw, _ = core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    assert _per_row(raw) == pytest.approx([0.0, -1.0, 1.0, 5.0], abs=1e-12)


def test_grpo_vectorized_keeps_precision_when_scores_nearly_agree():
    """2.0 and 2.00001: deviations +-5e-6, std = sqrt(2 * (5e-6)^2) = 7.0711e-6; a one-pass variance
    (sum x^2 - (sum x)^2 / n) loses these digits entirely in float32."""
    rewards = torch.tensor([[2.0], [2.00001]])
    std = math.sqrt(2 * 5e-6 ** 2)
    advantages, _ = core_algos.compute_grpo_vectorized_outcome_advantage(
        rewards, torch.ones_like(rewards), np.array(["p", "p"], dtype=object))
    assert _per_row(advantages) == pytest.approx([-5e-6 / (std + EPS), 5e-6 / (std + EPS)], rel=2e-2)


def test_rloo_vectorized_by_hand():
    # group a (n = 3): (3 s - sum) / 2 = (3 s - 3) / 2; the lone sample of b has no other to compare with: 0
    rewards, mask = _outcome_batch([1.0, 0.0, 2.0, 5.0])
    index = np.array(["a", "a", "a", "b"], dtype=object)
    advantages, _ = core_algos.compute_rloo_vectorized_outcome_advantage(rewards, mask, index)
    assert _per_row(advantages) == pytest.approx([0.0, -1.5, 1.5, 0.0])


def test_gpg_by_hand():
    # 4 samples, 3 with a non-zero score: alpha = 4 / 3; group a mean 1, b alone (mean 0)
    rewards, mask = _outcome_batch([1.0, 0.0, 2.0, 5.0])
    index = np.array(["a", "a", "a", "b"], dtype=object)
    advantages, _ = core_algos.compute_gpg_outcome_advantage(rewards, mask, index)
    assert _per_row(advantages) == pytest.approx([0.0, -4 / 3, 4 / 3, 20 / 3])
    halved, _ = core_algos.compute_gpg_outcome_advantage(rewards, mask, index, f_norm=2.0)
    assert _per_row(halved) == pytest.approx([0.0, -2 / 3, 2 / 3, 10 / 3])


# ---- GDPO ----

GDPO_COMPONENTS = {"acc": np.array([1.0, 0.0, 1.0, 1.0]), "fmt": np.array([0.5, 0.1, 0.2, 0.4])}


def _gdpo_expected(weights):
    """Per component, GRPO within the groups (rows 0-1, rows 2-3): a pair (x, y) normalises to
    (x - y) / 2 / (|x - y| / sqrt 2) = +-1/sqrt 2, and an equal pair to 0. acc: (+, -), (0, 0); fmt: (+, -), (-, +).
    The weighted sum is whitened over the 8 response tokens (each row's value twice): mean 0, unbiased var
    sum(2 v^2) / 7."""
    root_half = 1 / math.sqrt(2)
    acc = [root_half, -root_half, 0.0, 0.0]
    fmt = [root_half, -root_half, -root_half, root_half]
    combined = [weights[0] * a + weights[1] * f for a, f in zip(acc, fmt)]
    std = math.sqrt(sum(2 * v * v for v in combined) / 7)
    return [v / std for v in combined]


def test_gdpo_normalises_each_component_then_whitens_by_hand():
    rewards, mask = _outcome_batch([9.0, 9.0, 9.0, 9.0])  # the summed score is not what GDPO uses here
    index = np.array(["x", "x", "y", "y"], dtype=object)
    config = SimpleNamespace(get={"gdpo_reward_keys": ["acc", "fmt"], "gdpo_reward_weights": [1.0, 2.0]}.get)
    advantages, _ = core_algos.compute_gdpo_outcome_advantage(rewards, mask, index, config=config,
                                                              non_tensor_batch=dict(GDPO_COMPONENTS))
    assert _per_row(advantages) == pytest.approx(_gdpo_expected([1.0, 2.0]), abs=1e-4)


def test_gdpo_through_compute_advantage_reads_the_batch_columns_and_equal_weights_by_default():
    rewards, mask = _outcome_batch([9.0, 9.0, 9.0, 9.0])
    data = DataProto(batch={"token_level_rewards": rewards, "response_mask": mask},
                     non_tensor_batch={"uid": np.array(["x", "x", "y", "y"], dtype=object), **GDPO_COMPONENTS},
                     meta_info={})
    config = SimpleNamespace(get={"gdpo_reward_keys": ["acc", "fmt"], "gdpo_reward_weights": None}.get)
    core_algos.compute_advantage(data, "gdpo", config=config)
    assert _per_row(data.batch["advantages"]) == pytest.approx(_gdpo_expected([1.0, 1.0]), abs=1e-4)


def test_gdpo_names_a_missing_or_empty_component():
    rewards, mask = _outcome_batch([1.0, 0.0])
    index = np.array(["x", "x"], dtype=object)
    config = SimpleNamespace(get={"gdpo_reward_keys": ["acc"], "gdpo_reward_weights": None}.get)
    with pytest.raises(ValueError, match=r"names 'acc', which the batch lacks \(its non-tensor keys: \['fmt'\]\)"):
        core_algos.compute_gdpo_outcome_advantage(rewards, mask, index, config=config, non_tensor_batch={"fmt": [1, 2]})
    with pytest.raises(ValueError, match=r"reward component 'acc' is None \(the scorer gave no value\) in rows \[1\]"):
        core_algos.compute_gdpo_outcome_advantage(rewards, mask, index, config=config,
                                                  non_tensor_batch={"acc": [1.0, None]})


# ---- optimal token baseline ----

def _otb_inputs(mask_rows, rewards_rows, pi_rows, sum_pi_squared_rows):
    as_tensor = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    return (as_tensor(rewards_rows), as_tensor(mask_rows), np.array(["g", "g", "alone"], dtype=object),
            torch.log(as_tensor(pi_rows)), as_tensor(sum_pi_squared_rows))


def test_optimal_token_baseline_by_hand():
    """Group g: row 0 (3 tokens, reward 1 at the end), row 1 (2 tokens, reward 3); row 2 is alone.
    w = 1 - 2 pi + sum pi^2: row 0 1 - 1 + 0.5 = 0.5 (W = 0.5, 1, 1.5), row 1 1 - 0.5 + 0.25 = 0.75 (W = 0.75, 1.5).
    G: row 0 (1, 1, 1), row 1 (3, 3, 0). B_0 = (1*0.5 + 3*0.75) / 1.25 = 2.2, B_1 = (1*1 + 3*1.5) / 2.5 = 2.2,
    B_2 = row 0's own return 1, which handle_zero_tail replaces by 0 (row 0 alone is longer than row 1)."""
    rewards, mask, index, old_log_probs, sum_pi_squared = _otb_inputs(
        mask_rows=[[1, 1, 1], [1, 1, 0], [1, 1, 0]], rewards_rows=[[0, 0, 1], [0, 3, 0], [0, 4, 0]],
        pi_rows=[[0.5] * 3, [0.25] * 3, [0.5] * 3], sum_pi_squared_rows=[[0.5] * 3, [0.25] * 3, [0.3] * 3])
    advantages, returns = core_algos.compute_optimal_token_baseline_advantage(rewards, mask, index, old_log_probs,
                                                                              sum_pi_squared)
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1, 1], [3, 3, 0], [4, 4, 0]], dtype=torch.float64))
    expected = [[1 - 2.2, 1 - 2.2, 1 - 0.0], [3 - 2.2, 3 - 2.2, 0.0], [4.0, 4.0, 0.0]]  # the lone row: no baseline
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64), atol=1e-7, rtol=0)
    kept_tail, _ = core_algos.compute_optimal_token_baseline_advantage(rewards, mask, index, old_log_probs,
                                                                       sum_pi_squared, handle_zero_tail=False)
    assert kept_tail[0, 2].item() == pytest.approx(1 - 1.0, abs=1e-7)


def test_optimal_token_baseline_weighs_paths_by_the_squared_is_weights():
    """IS weight 2 on row 0 multiplies its w by 4: W = 2, 4; row 1 keeps 0.75, 1.5.
    B_0 = (1*2 + 3*0.75) / 2.75, B_1 = (1*4 + 3*1.5) / 5.5 (both 17/11)."""
    rewards, mask, index, old_log_probs, sum_pi_squared = _otb_inputs(
        mask_rows=[[1, 1, 1], [1, 1, 0], [1, 1, 0]], rewards_rows=[[0, 0, 1], [0, 3, 0], [0, 4, 0]],
        pi_rows=[[0.5] * 3, [0.25] * 3, [0.5] * 3], sum_pi_squared_rows=[[0.5] * 3, [0.25] * 3, [0.3] * 3])
    is_weights = torch.tensor([[2.0] * 3, [1.0] * 3, [1.0] * 3], dtype=torch.float64)
    advantages, _ = core_algos.compute_optimal_token_baseline_advantage(rewards, mask, index, old_log_probs,
                                                                        sum_pi_squared, rollout_is_weights=is_weights)
    assert advantages[0, :2].tolist() == pytest.approx([1 - 17 / 11] * 2, abs=1e-7)
    assert advantages[1, :2].tolist() == pytest.approx([3 - 17 / 11] * 2, abs=1e-7)


def test_tir_optimal_token_baseline_aligns_the_model_tokens_of_multi_turn_responses():
    """Row 1 has a tool token at position 1 (mask 0): TIR compares row 0's 2nd token with row 1's 2nd model token
    (position 2); OTB compares positions. w: row 0 0.5 (W = 0.5, 1), row 1 0.75 (W = 0.75, -, 1.5); returns: row 0
    (1, 1, 0), row 1 (3, 3, 3). TIR: B = 2.2 at both model tokens. OTB: B_0 = 2.2, B_1 = row 0 alone = 1,
    B_2 = row 1 alone = 3 (both rows have 2 tokens: no zero tail)."""
    rewards, mask, index, old_log_probs, sum_pi_squared = _otb_inputs(
        mask_rows=[[1, 1, 0], [1, 0, 1], [0, 0, 0]], rewards_rows=[[0, 1, 0], [0, 0, 3], [0, 0, 0]],
        pi_rows=[[0.5] * 3, [0.25] * 3, [0.5] * 3], sum_pi_squared_rows=[[0.5] * 3, [0.25] * 3, [0.3] * 3])
    tir, _ = core_algos.compute_multi_turn_optimal_token_baseline_advantage(rewards, mask, index, old_log_probs,
                                                                            sum_pi_squared)
    expected_tir = [[1 - 2.2, 1 - 2.2, 0.0], [3 - 2.2, 0.0, 3 - 2.2], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(tir, torch.tensor(expected_tir, dtype=torch.float64), atol=1e-7, rtol=0)
    otb, _ = core_algos.compute_optimal_token_baseline_advantage(rewards, mask, index, old_log_probs, sum_pi_squared)
    expected_otb = [[1 - 2.2, 1 - 1.0, 0.0], [3 - 2.2, 0.0, 3 - 3.0], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(otb, torch.tensor(expected_otb, dtype=torch.float64), atol=1e-7, rtol=0)


# ---- verl's call forms and registry contract ----

def test_verl_call_forms_config_keyword_and_gamma_from_config():
    rewards, mask = _outcome_batch([1.0, 0.0])
    index = np.array(["a", "a"], dtype=object)
    config = SimpleNamespace(gamma=0.5, norm_adv_by_std_in_grpo=True)
    config.get = lambda key, default=None: getattr(config, key, default)  # verl's configs answer .get
    # verl's wrappers forward config=; the estimators that take **kwargs also accept what they do not use
    for estimator in (core_algos.compute_grpo_outcome_advantage, core_algos.compute_rloo_outcome_advantage,
                      core_algos.compute_opo_outcome_advantage, core_algos.compute_grpo_passk_outcome_advantage):
        estimator(token_level_rewards=rewards, response_mask=mask, index=index, config=config)
    # grpo_passk in verl reads norm_adv_by_std_in_grpo from the config: scores (1, 0), std 0.7071 -> 1 / 0.7071
    passk, _ = core_algos.compute_grpo_passk_outcome_advantage(token_level_rewards=rewards, response_mask=mask,
                                                               index=index, config=config)
    assert _per_row(passk) == pytest.approx([1 / (math.sqrt(0.5) + EPS), 0.0])
    config.norm_adv_by_std_in_grpo = False
    passk, _ = core_algos.compute_grpo_passk_outcome_advantage(token_level_rewards=rewards, response_mask=mask,
                                                               index=index, config=config)
    assert _per_row(passk) == pytest.approx([1.0, 0.0])
    # reinforce_plus_plus in verl reads gamma from the config: rewards (0, 1) -> returns (0.5, 1), (0, 0)
    advantages, returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=rewards, response_mask=mask, config=config)
    torch.testing.assert_close(returns, torch.tensor([[0.5, 1.0], [0.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="pass gamma= or config="):
        core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask)


def test_registry_rebound_through_verls_path_is_the_one_registration_uses():
    import hybridrl.compat.verl.trainer.ppo.core_algos as verl_core_algos

    assert verl_core_algos is core_algos
    original = core_algos.ADV_ESTIMATOR_REGISTRY
    try:
        verl_core_algos.ADV_ESTIMATOR_REGISTRY = {"gae": original["gae"]}

        class Names(Enum):
            MINE = "mine_by_enum"

        @core_algos.register_adv_est(Names.MINE)
        def mine(token_level_rewards, response_mask, **kwargs):
            return token_level_rewards, token_level_rewards

        assert verl_core_algos.ADV_ESTIMATOR_REGISTRY == {"gae": original["gae"], "mine_by_enum": mine}
        assert core_algos.get_adv_estimator_fn("mine_by_enum") is mine
        assert "mine_by_enum" not in original
        with pytest.raises(ValueError, match="Unknown advantage estimator simply: grpo; registered: "
                                             r"\['gae', 'mine_by_enum'\]"):
            core_algos.get_adv_estimator_fn("grpo")
    finally:
        core_algos.ADV_ESTIMATOR_REGISTRY = original


def test_the_earlier_layouts_imports_still_work():
    from hybridrl.algorithms import compute_advantage, get_adv_estimator_fn, get_policy_loss_fn

    assert get_policy_loss_fn is core_algos.get_policy_loss_fn
    assert compute_advantage is core_algos.compute_advantage and get_adv_estimator_fn is core_algos.get_adv_estimator_fn
    with pytest.raises(ImportError, match="cannot import name 'not_a_name'"):
        from hybridrl.algorithms import not_a_name  # noqa: F401
