"""verl's policy losses beyond PPO's clip (cispo, dppo_tv, dppo_kl, sapo, geo_mean, dro, bypass_mode), agg_loss's
token-sum, the straight-through KL types and verl's value-loss keywords, each against a hand computation on a few
tokens: loss value, gradient with respect to log_prob, metrics."""
import math
from types import SimpleNamespace

import pytest
import torch

from hybridrl.algorithms import core_algos

LN = math.log


def _config(**policy_loss):
    """An actor config as the losses read it: clip 0.2 below, 0.28 above, dual clip / truncation at 3."""
    return SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                           tau_pos=1.0, tau_neg=1.05, policy_loss=SimpleNamespace(get=policy_loss.get, **policy_loss))


def _log_probs(probabilities):
    return torch.log(torch.tensor([probabilities], dtype=torch.float64)).requires_grad_(True)


def _loss_and_grad(name, old_probabilities, new_probabilities, advantages, mask=None, mode="token-mean",
                   config=None, **kwargs):
    old_log_prob, log_prob = _log_probs(old_probabilities).detach(), _log_probs(new_probabilities)
    advantages = torch.tensor([advantages], dtype=torch.float64)
    mask = torch.ones_like(advantages) if mask is None else torch.tensor([mask], dtype=torch.float64)
    loss, metrics = core_algos.get_policy_loss_fn(name)(old_log_prob, log_prob, advantages, mask, mode,
                                                        config or _config(), **kwargs)
    loss.backward()
    return loss.item(), log_prob.grad[0].tolist(), {key: float(value) for key, value in metrics.items()}


def test_cispo_weighs_each_log_prob_by_the_clipped_detached_ratio():
    # ratios 1.6 (clipped to 1.28), 1, 0.6 (clipped to 0.8); A = 1, -2, 3
    loss, grad, metrics = _loss_and_grad("cispo", [0.5, 0.5, 0.5], [0.8, 0.5, 0.3], [1.0, -2.0, 3.0])
    assert loss == pytest.approx((-1.28 * 1 * LN(0.8) + 1 * 2 * LN(0.5) - 0.8 * 3 * LN(0.3)) / 3)
    assert grad == pytest.approx([-1.28 / 3, 2 / 3, -2.4 / 3])  # every token keeps a gradient
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 3)


def test_dppo_tv_keeps_tokens_whose_probability_moved_within_the_bound():
    """(p_old, p, A): (.5, .8, +) moved +0.3 > 0.28: out; (.5, .6, +) +0.1: in, r 1.2; (.5, .35, -) -0.15 >= -0.2: in,
    r 0.7; (.5, .2, -) -0.3: out; (.05, .25, +2) +0.2: in, r 5 truncated to clip_ratio_c 3."""
    loss, grad, metrics = _loss_and_grad("dppo_tv", [0.5, 0.5, 0.5, 0.5, 0.05], [0.8, 0.6, 0.35, 0.2, 0.25],
                                         [1.0, 1.0, -1.0, -1.0, 2.0])
    assert loss == pytest.approx((-1.2 * LN(0.6) + 0.7 * LN(0.35) - 2 * 3 * LN(0.25)) / 5)
    assert grad == pytest.approx([0.0, -1.2 / 5, 0.7 / 5, 0.0, -6 / 5])
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)  # kept, ratio above clip_ratio_c


def test_dppo_kl_measures_the_move_by_the_bernoulli_kl():
    """KL(p_old || p) of the two-outcome distributions: (.5 -> .9) 0.5108 > 0.28 for A > 0: out; (.5 -> .7) 0.0872:
    in; (.5 -> .1, A > 0) moved against its push: in; (.5 -> .1, A < 0) 0.5108 > 0.2: out; (.5 -> .9, A < 0): in."""
    def binary_kl(old, new):
        return old * LN(old / new) + (1 - old) * LN((1 - old) / (1 - new))
    assert binary_kl(0.5, 0.9) == pytest.approx(0.5108, abs=1e-4) and binary_kl(0.5, 0.7) == pytest.approx(0.0872,
                                                                                                              abs=1e-4)
    loss, grad, metrics = _loss_and_grad("dppo_kl", [0.5] * 5, [0.9, 0.7, 0.1, 0.1, 0.9], [1.0, 1.0, 1.0, -1.0, -1.0])
    ratios = [1.8, 1.4, 0.2, 0.2, 1.8]
    kept = [0, 1, 1, 0, 1]
    advantages = [1.0, 1.0, 1.0, -1.0, -1.0]
    expected = sum(-a * r * LN(p) * k for a, r, p, k in zip(advantages, ratios, [0.9, 0.7, 0.1, 0.1, 0.9], kept)) / 5
    assert loss == pytest.approx(expected)
    assert grad == pytest.approx([-a * r * k / 5 for a, r, k in zip(advantages, ratios, kept)])
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)


def test_sapo_gates_the_ratio_smoothly_and_always_averages_per_sequence():
    """Row 0: r = 1 (A = 2): gate sigmoid(0) * 4 = 2, gradient -A * gate'(1) * r = -2; r = 1.5 (A = 1): gate
    4 sigmoid(0.5). Row 1 (one token): r = 0.5, A = -1, tau_neg 1.05: gate 4 sigmoid(-0.525) / 1.05.
    seq-mean-token-mean whatever the mode passed: row means, then their mean."""
    old = torch.log(torch.tensor([[0.4, 0.4], [0.4, 0.4]], dtype=torch.float64))
    log_prob = torch.log(torch.tensor([[0.4, 0.6], [0.2, 0.9]], dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor([[2.0, 1.0], [-1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = core_algos.compute_policy_loss_sapo(old, log_prob, advantages, mask, "token-mean", _config())
    loss.backward()
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    row0 = (-2 * 2 - 4 * sigmoid(0.5) * 1) / 2
    row1 = 4 * sigmoid(1.05 * -0.5) / 1.05 * 1
    assert loss.item() == pytest.approx((row0 + row1) / 2)
    assert log_prob.grad[0, 0].item() == pytest.approx(-2 / 2 / 2)  # gate'(1) = 1, r = 1, over 2 tokens and 2 rows
    assert log_prob.grad[1, 1].item() == 0.0


def test_geo_mean_clips_token_log_ratios_by_the_advantage_sign_then_takes_their_mean():
    """Row 0 (A = 1): log ratios 0.5 -> 0.28 (upper clip binds for A > 0), -0.3 stays; mean -0.01.
    Row 1 (A = -2): -0.5 -> -0.2 (lower clip binds for A < 0), 0.1 stays; mean -0.05. Row 2 has no token.
    Loss: the mean over the 2 sequences of -A exp(mean)."""
    old = torch.zeros(3, 2, dtype=torch.float64) - 1.0
    log_prob = (old + torch.tensor([[0.5, -0.3], [-0.5, 0.1], [0.0, 0.0]], dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0], [-2.0, -2.0], [7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    loss, metrics = core_algos.compute_policy_loss_geo_mean(old, log_prob, advantages, mask, "token-mean", _config())
    assert loss.item() == pytest.approx((-math.exp(-0.01) + 2 * math.exp(-0.05)) / 2)
    loss.backward()
    # only the unclipped tokens carry a gradient: d/dx of -A exp(mean) = -A exp(mean) / 2 tokens, over 2 sequences
    assert log_prob.grad.flatten().tolist() == pytest.approx([0.0, -math.exp(-0.01) / 4, 0.0, 2 * math.exp(-0.05) / 4,
                                                              0.0, 0.0])
    # tokens whose log ratio lies outside [-0.2, 0.28], by advantage sign: 0.5 and -0.3 (A > 0), -0.5 (A < 0)
    assert float(metrics["actor/pg_clipfrac"]) == pytest.approx(2 / 4)
    assert float(metrics["actor/pg_clipfrac_lower"]) == pytest.approx(1 / 4)
    weights = torch.tensor([[4.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)  # row 0's geometric mean: 2
    weighted, _ = core_algos.compute_policy_loss_geo_mean(old, log_prob.detach(), advantages, mask, "token-mean",
                                                          _config(), rollout_is_weights=weights)
    assert weighted.item() == pytest.approx((-2 * math.exp(-0.01) + 2 * math.exp(-0.05)) / 2, rel=1e-6)


def test_dro_is_the_policy_gradient_with_a_quadratic_log_ratio_penalty():
    # log ratios 0.2 and 0; beta 0.5: -(A log p - 0.25 (log ratio)^2), gradient -(A - beta * log ratio)
    old = torch.tensor([[-0.7, -1.0]], dtype=torch.float64)
    log_prob = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[2.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    loss, _ = core_algos.compute_policy_loss_dro(old, log_prob, advantages, mask, "token-mean",
                                                 _config(dro_beta=0.5))
    assert loss.item() == pytest.approx((-(2 * -0.5 - 0.25 * 0.04) - (-1 * -1.0)) / 2)
    loss.backward()
    assert log_prob.grad[0].tolist() == pytest.approx([-(2 - 0.5 * 0.2) / 2, 1 / 2])
    with pytest.raises(ValueError, match="policy_loss.dro_beta must be > 0 with loss_mode='dro', got None"):
        core_algos.compute_policy_loss_dro(old, log_prob, advantages, mask, "token-mean", _config(dro_beta=None))


def test_bypass_mode_ppo_clip_is_vanilla_and_reinforce_applies_its_own_truncated_is_weights():
    """old_log_prob is the rollout's here. Ratios pi / pi_rollout: 2 (truncated to 1.5), 1, 0.5."""
    rollout, new, advantages = [0.25, 0.5, 0.5], [0.5, 0.5, 0.25], [1.0, -1.0, 2.0]
    correction = {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": None}
    clip = _loss_and_grad("bypass_mode", rollout, new, advantages,
                          config=_config(rollout_correction={"loss_type": "ppo_clip", **correction}))
    vanilla = _loss_and_grad("vanilla", rollout, new, advantages)
    assert clip[0] == pytest.approx(vanilla[0]) and clip[1] == pytest.approx(vanilla[1])
    assert "rollout_corr/rollout_is_mean" in clip[2]
    loss, grad, metrics = _loss_and_grad("bypass_mode", rollout, new, advantages,
                                         config=_config(rollout_correction={"loss_type": "reinforce", **correction}))
    weights = [1.5, 1.0, 0.5]
    assert loss == pytest.approx(sum(-a * w * LN(p) for a, w, p in zip(advantages, weights, new)) / 3)
    assert grad == pytest.approx([-a * w / 3 for a, w in zip(advantages, weights)])
    assert metrics["actor/ppo_kl"] == pytest.approx((LN(0.25 / 0.5) + 0 + LN(0.5 / 0.25)) / 3)
    with pytest.raises(ValueError, match="needs actor.policy_loss.rollout_correction"):
        _loss_and_grad("bypass_mode", rollout, new, advantages)


def test_token_sum_and_straight_through_kl_and_verls_value_loss_keywords():
    loss_mat = torch.tensor([[1.0, 2.0], [4.0, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    assert core_algos.agg_loss(loss_mat, mask, "token-sum").item() == 7.0
    assert core_algos.agg_loss(loss_mat, mask, "token-sum", dp_size=2).item() == 14.0
    # k3+ at p = 0.5, p_ref = 0.25: k3's value 0.5 - ln 0.5 - 1, k2's gradient log p - log p_ref = ln 2
    log_prob = torch.tensor([LN(0.5)], requires_grad=True)
    value = core_algos.kl_penalty(log_prob, torch.tensor([LN(0.25)]), "k3+")
    value.sum().backward()
    assert value.item() == pytest.approx(0.5 - LN(0.5) - 1) and log_prob.grad.item() == pytest.approx(LN(2))
    # 0.5 * sum of squared errors (1 + 4 on the masked-in tokens) / global tokens 4 * dp_size 2
    vf_loss, _ = core_algos.compute_value_loss(torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[0.0, 0.0, 5.0]]),
                                               torch.tensor([[1.0, 2.0, 0.0]]), torch.tensor([[1, 1, 0]]),
                                               cliprange_value=10.0, dp_size=2, batch_num_tokens=4)
    assert vf_loss.item() == pytest.approx(0.5 * 5 / 4 * 2)
