"""compute_advantage over a real DataProto, and estimators / policy losses registered from a user's own file."""
import importlib.util
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.algorithms import core_algos
from hybridrl.algorithms.core_algos import AdvantageEstimator


def _batch():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    tensors = {"token_level_rewards": torch.randn(6, 4, generator=g) * mask,
               "values": torch.randn(6, 4, generator=g),
               "reward_baselines": torch.randn(6, generator=g),
               "old_log_probs": -torch.rand(6, 4, generator=g),
               "sum_pi_squared": torch.rand(6, 4, generator=g),
               "response_mask": mask}
    uids = np.array(["a", "a", "a", "b", "c", "c"], dtype=object)
    return DataProto(batch=tensors, non_tensor_batch={"uid": uids}, meta_info={})


def _direct_call(name, batch, uids):
    """Each built-in estimator called by hand with gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=False."""
    rewards, mask = batch["token_level_rewards"], batch["response_mask"]
    if name == "gae":
        return core_algos.compute_gae_advantage_return(rewards, batch["values"], mask, 0.9, 0.8)
    if name == "grpo":
        return core_algos.compute_grpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=False)
    if name == "grpo_passk":
        return core_algos.compute_grpo_passk_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=False)
    if name in ("grpo_vectorized", "gdpo"):
        return core_algos.get_adv_estimator_fn(name)(rewards, mask, uids, norm_adv_by_std_in_grpo=False)
    if name == "reinforce_plus_plus":
        return core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.9)
    if name == "remax":
        return core_algos.compute_remax_outcome_advantage(rewards, batch["reward_baselines"], mask)
    if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        return core_algos.get_adv_estimator_fn(name)(rewards, mask, uids, batch["old_log_probs"],
                                                     batch["sum_pi_squared"])
    estimator = {"rloo": core_algos.compute_rloo_outcome_advantage, "opo": core_algos.compute_opo_outcome_advantage,
                 "reinforce_plus_plus_baseline": core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage,
                 "gpg": core_algos.compute_gpg_outcome_advantage,
                 "rloo_vectorized": core_algos.compute_rloo_vectorized_outcome_advantage}
    return estimator[name](rewards, mask, uids)


@pytest.mark.parametrize("name", [member.value for member in AdvantageEstimator])
def test_compute_advantage_routes_the_batch_and_settings_to_each_builtin(name):
    data = _batch()
    if name == "grpo_passk":  # needs groups of two or more
        data = DataProto(batch={k: v[[0, 1, 2, 4, 5]] for k, v in data.batch.items()},
                         non_tensor_batch={"uid": data.non_tensor_batch["uid"][[0, 1, 2, 4, 5]]}, meta_info={})
    expected_advantages, expected_returns = _direct_call(name, dict(data.batch), data.non_tensor_batch["uid"])
    result = core_algos.compute_advantage(data, name, gamma=0.9, lam=0.8, norm_adv_by_std_in_grpo=False)
    assert result is data
    torch.testing.assert_close(data.batch["advantages"], expected_advantages)
    torch.testing.assert_close(data.batch["returns"], expected_returns)
    assert data.batch["advantages"].abs().sum() > 0


def test_compute_advantage_passes_norm_adv_by_std_in_grpo():
    normed, raw = _batch(), _batch()
    core_algos.compute_advantage(normed, "grpo", norm_adv_by_std_in_grpo=True)
    core_algos.compute_advantage(raw, "grpo", norm_adv_by_std_in_grpo=False)
    assert not torch.allclose(normed.batch["advantages"], raw.batch["advantages"])


def test_compute_advantage_names_missing_inputs_and_unknown_estimators():
    data = _batch()
    data.non_tensor_batch.pop("uid")
    with pytest.raises(ValueError, match="'grpo' needs \\[\"non-tensor batch key 'uid'\"\\]"):
        core_algos.compute_advantage(data, "grpo")
    data.batch.pop("values")
    with pytest.raises(ValueError, match="'gae' needs \\[\"batch key 'values'\"\\]"):
        core_algos.compute_advantage(data, "gae")
    with pytest.raises(ValueError, match=r"Unknown advantage estimator simply: ppo; registered: \['gae', 'gdpo'"):
        core_algos.compute_advantage(data, "ppo")


def test_builtin_names_resolve_by_string_and_enum_and_duplicates_are_refused():
    assert core_algos.get_adv_estimator_fn("grpo") is core_algos.get_adv_estimator_fn(AdvantageEstimator.GRPO)
    assert core_algos.get_adv_estimator_fn("gae") is core_algos.compute_gae_advantage_return
    with pytest.raises(ValueError, match="'rloo' is already registered"):
        core_algos.register_adv_est(AdvantageEstimator.RLOO)(lambda token_level_rewards, response_mask: None)


USER_MODULE = textwrap.dedent('''
    """A user's extension, written without touching hybridrl."""
    import torch

    from hybridrl.algorithms.core_algos import agg_loss, register_adv_est, register_policy_loss


    @register_adv_est("test_user_scaled_score")
    def scaled_score(token_level_rewards, response_mask, config):
        """Advantage = config.scale * sequence score on every response token."""
        advantages = config.scale * token_level_rewards.sum(-1, keepdim=True) * response_mask
        return advantages, advantages


    @register_adv_est("test_user_sees_everything")
    def sees_everything(**inputs):
        """Reports which inputs it was given, as the number of them, in every entry."""
        shape = inputs["token_level_rewards"].shape
        return torch.full(shape, float(len(inputs))), torch.zeros(shape)


    @register_policy_loss("test_user_reinforce")
    def reinforce(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None):
        return agg_loss(-advantages * log_prob, response_mask, loss_agg_mode), {"actor/user_metric": 1.0}
''')


@pytest.fixture
def user_extension(tmp_path):
    path = tmp_path / "my_algorithms.py"
    path.write_text(USER_MODULE)
    spec = importlib.util.spec_from_file_location("my_algorithms", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for name in ("test_user_scaled_score", "test_user_sees_everything"):
        core_algos.ADV_ESTIMATOR_REGISTRY.pop(name)
    core_algos.POLICY_LOSS_REGISTRY.pop("test_user_reinforce")


def test_user_registered_estimator_and_policy_loss_are_selected_by_name(user_extension):
    data = _batch()
    core_algos.compute_advantage(data, "test_user_scaled_score", config=SimpleNamespace(scale=2.0))
    rewards, mask = data.batch["token_level_rewards"], data.batch["response_mask"]
    for i in range(6):
        score = sum(rewards[i].tolist())
        for t in range(4):
            assert data.batch["advantages"][i, t].item() == pytest.approx(2.0 * score if mask[i, t] else 0.0, abs=1e-6)

    core_algos.compute_advantage(data, "test_user_sees_everything")
    # gamma, lam, norm_adv_by_std_in_grpo, config, batch, non_tensor_batch, 6 batch keys, index
    assert torch.all(data.batch["advantages"] == 13.0)

    loss_fn = core_algos.get_policy_loss_fn("test_user_reinforce")
    assert loss_fn is user_extension.reinforce
    log_prob, advantages = torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 3.0]])
    loss, metrics = loss_fn(log_prob, log_prob, advantages, torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(1.0) and metrics == {"actor/user_metric": 1.0}
