"""Loss aggregation, policy losses, value and entropy losses against float64 per-token references."""
import math
from types import SimpleNamespace

import pytest
import torch

from hybridrl.algorithms import core_algos

BATCH, LENGTH = 8, 7
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _actor_config(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28, clip_ratio_c=3.0, **policy_loss):
    return SimpleNamespace(clip_ratio=clip_ratio, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                           clip_ratio_c=clip_ratio_c, policy_loss=SimpleNamespace(**policy_loss))


def _random_policy_batch(seed):
    """old/new log-probs with ratios in [e^-2, e^2] (clip and dual-clip regions), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (BATCH,), generator=g)
    lengths[0], lengths[1] = 0, LENGTH
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    old_log_prob = -torch.rand(BATCH, LENGTH, generator=g) * 2
    log_prob = old_log_prob + (torch.rand(BATCH, LENGTH, generator=g) * 4 - 2)
    advantages = torch.randn(BATCH, LENGTH, generator=g)
    return old_log_prob, log_prob.requires_grad_(True), advantages, mask


def _valid(mask):
    return [(i, t) for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i, t]]


def _reference_agg(token_losses, mask, mode):
    """token_losses: dict (i, t) -> loss over the masked tokens."""
    rows = [[token_losses[(i, t)] for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    if mode == "token-mean":
        return math.fsum(token_losses.values()) / len(token_losses)
    non_empty = [row for row in rows if row]  # a fully-masked row is in no mean
    if mode == "seq-mean-token-sum":
        return math.fsum(math.fsum(row) for row in non_empty) / len(non_empty)
    if mode == "seq-mean-token-mean":
        return math.fsum(math.fsum(row) / len(row) for row in non_empty) / len(non_empty)
    # Dr. GRPO (verl >= 0.7.1): the mean over the sequences of their token sums, over the padded width
    return math.fsum(math.fsum(row) for row in non_empty) / len(non_empty) / mask.shape[1]


def _floats(*tensors, at):
    return [x[at].item() for x in tensors]


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_reference(mode):
    g = torch.Generator().manual_seed(0)
    _, _, _, mask = _random_policy_batch(0)
    loss_mat = torch.randn(BATCH, LENGTH, generator=g, dtype=torch.float64)
    expected = _reference_agg({at: loss_mat[at].item() for at in _valid(mask)}, mask, mode)
    assert core_algos.agg_loss(loss_mat, mask, mode).item() == pytest.approx(expected, rel=1e-10)


def test_agg_loss_literals_and_invalid_mode():
    """The third row is fully masked: it is in no mean (verl leaves it out too); its 9s never count."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert core_algos.agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert core_algos.agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert core_algos.agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert core_algos.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 + 4) / 2 / 3)
    with pytest.raises(ValueError, match="'seq-mean-token-sum-norm'"):
        core_algos.agg_loss(loss_mat, mask, "sum")


def test_seq_mean_token_sum_norm_does_not_grow_with_the_batch_size():
    """Dr. GRPO's objective is a mean over the responses (verl since 0.7.1): the batch repeated 4 times gives the
    same loss, where verl 0.7.0's sum over the responses gave 4 times as much."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    once = core_algos.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")
    four_times = core_algos.agg_loss(loss_mat.repeat(4, 1), mask.repeat(4, 1), "seq-mean-token-sum-norm")
    assert once.item() == pytest.approx(5 / 3)
    assert four_times.item() == pytest.approx(5 / 3)


def test_agg_loss_with_global_counts_and_an_empty_batch():
    """A micro-batch of one rank: its sum over the global count, times the number of ranks."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    agg = core_algos.agg_loss
    assert agg(loss_mat, mask, "token-mean", dp_size=2, batch_num_tokens=8).item() == pytest.approx(10 / 8 * 2)
    assert agg(loss_mat, mask, "seq-mean-token-sum", dp_size=2, global_batch_size=5).item() == pytest.approx(10 / 5 * 2)
    assert agg(loss_mat, mask, "seq-mean-token-mean", dp_size=4,
               global_batch_size=8).item() == pytest.approx((2 + 4) / 8 * 4)
    assert agg(loss_mat, mask, "seq-mean-token-sum-norm", dp_size=2, global_batch_size=4,
               loss_scale_factor=10).item() == pytest.approx((6 + 4) / 4 * 2 / 10)
    empty = torch.zeros_like(mask)
    for mode in MODES:  # nothing to learn from: 0, never NaN (even with a NaN under the padding)
        assert agg(torch.full((3, 3), float("nan")), empty, mode).item() == 0.0


def _reference_vanilla_token(old, new, advantage, eps_low, eps_high, clip_ratio_c):
    """(loss, d loss / d new, pg clipped?, dual clipped?) for one token."""
    ratio = math.exp(min(max(new - old, -20.0), 20.0))
    unclipped = -advantage * ratio
    clipped = -advantage * min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss, grad = (unclipped, -advantage * ratio) if unclipped >= clipped else (clipped, 0.0)
    dual = advantage < 0 and loss > -advantage * clip_ratio_c
    if dual:
        loss, grad = -advantage * clip_ratio_c, 0.0
    return loss, grad, clipped > unclipped, dual


@pytest.mark.parametrize("mode", MODES)
def test_vanilla_policy_loss_matches_reference_in_every_region(mode):
    old, new, advantages, mask = _random_policy_batch(1)
    config = _actor_config()
    loss, metrics = core_algos.get_policy_loss_fn("vanilla")(old, new, advantages, mask, mode, config)
    reference = {at: _reference_vanilla_token(*_floats(old, new, advantages, at=at), 0.2, 0.28, 3.0)
                 for at in _valid(mask)}
    clipped = [at for at, r in reference.items() if r[2]]
    dual = [at for at, r in reference.items() if r[3]]
    assert any(advantages[at] > 0 for at in clipped) and any(advantages[at] < 0 for at in clipped) and dual
    assert loss.item() == pytest.approx(_reference_agg({at: r[0] for at, r in reference.items()}, mask, mode), rel=1e-5)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(len(clipped) / len(reference))
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(len(dual) / len(reference))
    kl = math.fsum(old[at].item() - new[at].item() for at in reference) / len(reference)
    assert metrics["actor/ppo_kl"].item() == pytest.approx(kl, rel=1e-5)
    if mode == "token-mean":
        loss.backward()
        expected_grad = torch.zeros(BATCH, LENGTH, dtype=torch.float64)
        for at, r in reference.items():
            expected_grad[at] = r[1] / len(reference)
        torch.testing.assert_close(new.grad.double(), expected_grad, rtol=1e-5, atol=1e-7)


def test_vanilla_literal_clip_higher_and_dual_clip():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[2.0, 5.0, 1.1]]))
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    loss, metrics = core_algos.compute_policy_loss_vanilla(old, new, advantages, torch.ones(1, 3), "token-mean",
                                                           _actor_config(clip_ratio=0.2, clip_ratio_high=None))
    # token 1: max(-2, -1.2) = -1.2 (clipped); token 2: max(5, 1.2) = 5, dual-capped at 3; token 3: -1.1
    assert loss.item() == pytest.approx((-1.2 + 3.0 - 1.1) / 3, rel=1e-6)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert metrics["actor/pg_clipfrac_lower"].item() == pytest.approx(1 / 3)
    # clip-higher: with eps_high = 1.5 the ratio 2 is inside the range
    loss, _ = core_algos.compute_policy_loss_vanilla(old[:, :1], new[:, :1], advantages[:, :1], torch.ones(1, 1),
                                                     "token-mean", _actor_config(clip_ratio_high=1.5))
    assert loss.item() == pytest.approx(-2.0, rel=1e-6)


def test_vanilla_rejects_missing_config_and_bad_dual_clip_bound():
    args = (torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="needs a config with clip_ratio"):
        core_algos.compute_policy_loss_vanilla(*args)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        core_algos.compute_policy_loss_vanilla(*args, "token-mean", _actor_config(clip_ratio_c=1.0))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_gspo_matches_reference(mode):
    old, new, advantages, mask = _random_policy_batch(2)
    new = (old + (new.detach() - old) * 0.1).requires_grad_(True)  # sequence ratios around 1, some clipped
    loss, metrics = core_algos.get_policy_loss_fn("gspo")(old, new, advantages, mask, mode,
                                                          _actor_config(clip_ratio_low=0.03, clip_ratio_high=0.04))
    reference, n_clipped = {}, 0
    for i in range(BATCH):
        positions = [(i, t) for t in range(LENGTH) if mask[i, t]]
        if not positions:
            continue
        seq_ratio = math.exp(math.fsum(new[at].item() - old[at].item() for at in positions) / len(positions))
        for at in positions:
            a = advantages[at].item()
            unclipped, clipped = -a * seq_ratio, -a * min(max(seq_ratio, 0.97), 1.04)
            n_clipped += clipped > unclipped
            reference[at] = (max(unclipped, clipped), -a * seq_ratio if unclipped >= clipped else 0.0)
    assert 0 < n_clipped < len(reference)
    assert loss.item() == pytest.approx(_reference_agg({at: r[0] for at, r in reference.items()}, mask, mode), rel=1e-5)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(n_clipped / len(reference))
    if mode == "token-mean":  # each token's gradient is its own: d/d log pi_t = -A_t * s
        loss.backward()
        expected_grad = torch.zeros(BATCH, LENGTH, dtype=torch.float64)
        for at, r in reference.items():
            expected_grad[at] = r[1] / len(reference)
        torch.testing.assert_close(new.grad.double(), expected_grad, rtol=1e-5, atol=1e-7)


def test_gpg_is_plain_policy_gradient():
    old, new, advantages, mask = _random_policy_batch(3)
    loss, _ = core_algos.get_policy_loss_fn("gpg")(old, new, advantages, mask, "token-mean", None)
    valid = _valid(mask)
    expected = math.fsum(-advantages[at].item() * new[at].item() for at in valid) / len(valid)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    for at in valid:
        assert new.grad[at].item() == pytest.approx(-advantages[at].item() / len(valid), rel=1e-5)


def _reference_covariances(advantages, log_prob, mask):
    valid = _valid(mask)
    mean_a = math.fsum(advantages[at].item() for at in valid) / len(valid)
    mean_lp = math.fsum(log_prob[at].item() for at in valid) / len(valid)
    return {at: (advantages[at].item() - mean_a) * (log_prob[at].item() - mean_lp) for at in valid}


@pytest.mark.parametrize("clip_cov_ratio", [0.1, 1.0])  # 2 of the 6 candidates at random; all 6
def test_clip_cov_drops_the_right_number_of_high_covariance_tokens(clip_cov_ratio):
    torch.manual_seed(0)
    old, new, advantages, mask = _random_policy_batch(4)
    new = (old + (new.detach() - old) * 0.15).requires_grad_(True)  # ratios in [0.74, 1.35]: some PPO-clipped
    config = _actor_config(clip_cov_ratio=clip_cov_ratio, clip_cov_lb=0.1, clip_cov_ub=1.0)
    loss, metrics = core_algos.get_policy_loss_fn("clip_cov")(old, new, advantages, mask, "token-mean", config)
    loss.backward()
    covariances = _reference_covariances(advantages, new.detach(), mask)
    ppo = {at: _reference_vanilla_token(*_floats(old, new, advantages, at=at), 0.2, 0.28, 1e9) for at in covariances}
    candidates = {at for at, c in covariances.items() if 0.1 < c < 1.0 and not ppo[at][2]}
    n_expected = min(max(int(clip_cov_ratio * len(covariances)), 1), len(candidates))
    dropped = {at for at in covariances if new.grad[at] == 0 and not ppo[at][2]}
    assert len(candidates) > 4 and len(dropped) == n_expected and dropped <= candidates
    expected = math.fsum(0.0 if at in dropped else r[0] for at, r in ppo.items()) / len(ppo)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(n_expected / len(covariances))


@pytest.mark.parametrize("kl_cov_ratio", [0.1, 0.5])
def test_kl_cov_penalises_the_top_covariance_tokens(kl_cov_ratio):
    old, new, advantages, mask = _random_policy_batch(5)
    config = _actor_config(kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=0.7)
    loss, metrics = core_algos.get_policy_loss_fn("kl_cov")(old, new, advantages, mask, "token-mean", config)
    covariances = _reference_covariances(advantages, new.detach(), mask)
    n_penalised = max(1, int(len(covariances) * kl_cov_ratio))
    top = set(sorted(covariances, key=covariances.get, reverse=True)[:n_penalised])
    token_losses = []
    for at in covariances:
        a, log_ratio = advantages[at].item(), new[at].item() - old[at].item()
        token_losses.append(-a * math.exp(log_ratio) + (0.7 * abs(log_ratio) if at in top else 0.0))
    assert loss.item() == pytest.approx(math.fsum(token_losses) / len(token_losses), rel=1e-5)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(n_penalised / len(covariances))


def test_policy_loss_registry_errors():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo2'; registered: \[.*'clip_cov'.*'vanilla'"):
        core_algos.get_policy_loss_fn("ppo2")
    with pytest.raises(ValueError, match="already registered to .*compute_policy_loss_vanilla"):
        core_algos.register_policy_loss("vanilla")(lambda *args, **kwargs: None)
    assert core_algos.register_policy_loss("vanilla")(core_algos.compute_policy_loss_vanilla) \
        is core_algos.get_policy_loss_fn("vanilla")


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_matches_reference(mode):
    g = torch.Generator().manual_seed(6)
    _, _, _, mask = _random_policy_batch(6)
    vpreds, returns, values = (torch.randn(BATCH, LENGTH, generator=g) for _ in range(3))
    vf_loss, vf_clipfrac = core_algos.compute_value_loss(vpreds, returns, values, mask, 0.5, mode)
    reference, n_clipped = {}, 0
    for at in _valid(mask):
        v, ret, old = _floats(vpreds, returns, values, at=at)
        unclipped, clipped = (v - ret) ** 2, (min(max(v, old - 0.5), old + 0.5) - ret) ** 2
        reference[at] = 0.5 * max(unclipped, clipped)
        n_clipped += clipped > unclipped
    assert 0 < n_clipped
    assert vf_loss.item() == pytest.approx(_reference_agg(reference, mask, mode), rel=1e-5)
    assert vf_clipfrac.item() == pytest.approx(n_clipped / len(reference))


def test_value_loss_literal():
    vf_loss, vf_clipfrac = core_algos.compute_value_loss(torch.tensor([[1.5]]), torch.tensor([[2.0]]),
                                                         torch.tensor([[1.0]]), torch.ones(1, 1), 0.2, "token-mean")
    # clipped prediction 1.2: max(0.25, 0.64) / 2
    assert vf_loss.item() == pytest.approx(0.32) and vf_clipfrac.item() == 1.0


def test_entropy_loss_matches_reference():
    g = torch.Generator().manual_seed(7)
    _, _, _, mask = _random_policy_batch(7)
    logits = torch.randn(BATCH, LENGTH, 5, generator=g) * 2
    entropies = {}
    for at in _valid(mask):
        probs = torch.softmax(logits[at].double(), dim=-1).tolist()
        entropies[at] = -math.fsum(p * math.log(p) for p in probs)
    for mode in MODES:
        loss = core_algos.compute_entropy_loss(logits, mask, mode)
        assert loss.item() == pytest.approx(_reference_agg(entropies, mask, mode), rel=1e-5)
