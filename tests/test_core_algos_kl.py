"""KL estimators, KL controllers and the in-reward KL penalty over a real DataProto."""
import math
from types import SimpleNamespace

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.algorithms import core_algos


def _reference_kl(logprob, ref_logprob, kind):
    diff = logprob - ref_logprob
    if kind in ("kl", "k1"):
        return diff
    if kind == "abs":
        return abs(diff)
    if kind in ("mse", "k2"):
        return 0.5 * diff * diff
    log_ref_ratio = min(max(-diff, -20.0), 20.0)
    return min(max(math.exp(log_ref_ratio) - log_ref_ratio - 1.0, -10.0), 10.0)


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty_matches_reference(kind):
    g = torch.Generator().manual_seed(0)
    logprob = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    ref_logprob = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    result = core_algos.kl_penalty(logprob, ref_logprob, kind)
    for i in range(4):
        for t in range(5):
            expected = _reference_kl(logprob[i, t].item(), ref_logprob[i, t].item(), kind)
            assert result[i, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_low_var_kl_literals_nonnegative_and_clamped():
    logprob = torch.tensor([0.0, math.log(0.5), -20.0])
    ref_logprob = torch.tensor([0.0, 0.0, -5.0])
    # equal -> 0; ratio pi_ref/pi = 2 -> 2 - ln 2 - 1; ratio e^15 -> clamped to 10
    assert core_algos.kl_penalty(logprob, ref_logprob, "low_var_kl").tolist() == \
        pytest.approx([0.0, 1.0 - math.log(2.0), 10.0], abs=1e-6)


def test_kl_penalty_full_is_not_implemented_and_unknown_names_list_the_choices():
    with pytest.raises(NotImplementedError, match="full vocabulary"):
        core_algos.kl_penalty(torch.zeros(1), torch.zeros(1), "full")
    with pytest.raises(ValueError, match=r"kl_penalty='k4' is not one of \['kl', 'k1', 'abs', 'mse'"):
        core_algos.kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_adaptive_kl_controller_literal_updates_and_fixed_stays():
    adaptive = core_algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    adaptive.update(current_kl=9.0, n_steps=256)   # error clipped from 0.5 to 0.2
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    adaptive.update(current_kl=5.4, n_steps=100)   # error -0.1
    assert adaptive.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 100 / 10000))
    fixed = core_algos.FixedKLController(kl_coef=0.3)
    fixed.update(current_kl=100.0, n_steps=1000)
    assert fixed.value == 0.3


def test_get_kl_controller_reads_the_config_and_rejects_bad_values():
    fixed = core_algos.get_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.01, target_kl=0.1, horizon=10))
    assert isinstance(fixed, core_algos.FixedKLController) and fixed.value == 0.01
    adaptive = core_algos.get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.02, target_kl=0.5, horizon=7))
    assert isinstance(adaptive, core_algos.AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.02, 0.5, 7)
    with pytest.raises(ValueError, match=r"algorithm.kl_ctrl.type='pid' is not one of \['fixed', 'adaptive'\]"):
        core_algos.get_kl_controller(SimpleNamespace(type="pid", kl_coef=0.01, target_kl=0.1, horizon=10))
    with pytest.raises(ValueError, match="horizon must be > 0"):
        core_algos.get_kl_controller(SimpleNamespace(type="adaptive", kl_coef=0.01, target_kl=0.1, horizon=0))


@pytest.mark.parametrize("kind", ["kl", "low_var_kl"])
def test_apply_kl_penalty_matches_reference_and_feeds_the_controller(kind):
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    scores = torch.randn(3, 4, generator=g)
    old_log_probs, ref_log_prob = -torch.rand(3, 4, generator=g) * 2, -torch.rand(3, 4, generator=g) * 2
    data = DataProto(batch={"token_level_scores": scores, "old_log_probs": old_log_probs,
                            "ref_log_prob": ref_log_prob, "response_mask": mask}, non_tensor_batch={}, meta_info={})
    controller = core_algos.AdaptiveKLController(init_kl_coef=0.5, target_kl=0.01, horizon=100)
    data, metrics = core_algos.apply_kl_penalty(data, controller, kl_penalty=kind)

    row_means = []
    for i in range(3):
        token_kls = []
        for t in range(4):
            kl = _reference_kl(old_log_probs[i, t].item(), ref_log_prob[i, t].item(), kind) if mask[i, t] else 0.0
            assert data.batch["token_level_rewards"][i, t].item() == pytest.approx(scores[i, t].item() - 0.5 * kl,
                                                                                   rel=1e-5, abs=1e-6)
            if mask[i, t]:
                token_kls.append(kl)
        row_means.append(math.fsum(token_kls) / len(token_kls) if token_kls else 0.0)
    current_kl = math.fsum(row_means) / 3
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, rel=1e-5)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.5
    error = min(max(current_kl / 0.01 - 1, -0.2), 0.2)
    assert controller.value == pytest.approx(0.5 * (1 + error * 3 / 100), rel=1e-6)
