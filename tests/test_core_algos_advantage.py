"""Advantage estimators against float64 references written per sample / per group with python loops.

The random batch has a group of three with a fully-masked row, a group of one, a group whose
scores are all equal (std 0) and an ordinary group; literal cases are worked out by hand.
"""
import math

import numpy as np
import pytest
import torch

from hybridrl.algorithms import core_algos

LENGTH = 6


def _random_batch(seed, interior_holes=False):
    """token_level_rewards (10, 6) zero on padding, values, response_mask and prompt uids."""
    g = torch.Generator().manual_seed(seed)
    uids = np.array(["p0"] * 3 + ["p1"] + ["p2"] * 3 + ["p3"] * 3, dtype=object)
    lengths = torch.randint(1, LENGTH + 1, (10,), generator=g)
    lengths[1] = 0          # fully-masked row inside group p0
    lengths[4:7] = LENGTH   # group p2: full rows, equal scores below
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    if interior_holes:      # tool-output tokens inside a multi-turn response
        mask[7, 1:3] = 0
        mask[8, 2] = 0
    rewards = torch.randn(10, LENGTH, generator=g) * mask
    rewards[4:7] = 0.0
    rewards[4:7, -1] = 0.5
    values = torch.randn(10, LENGTH, generator=g)
    return rewards, values, mask, uids


def _valid_positions(mask, row):
    return [t for t in range(mask.shape[1]) if mask[row, t]]


def _scores(rewards):
    return [math.fsum(row) for row in rewards.double().tolist()]


def _group_members(uids, row):
    return [j for j in range(len(uids)) if uids[j] == uids[row]]


def _mean_std(xs):
    mean = math.fsum(xs) / len(xs)
    return mean, math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _whiten_over_mask(matrix, mask):
    """Whiten a list-of-lists over the masked entries (unbiased variance + 1e-8) and zero the rest."""
    kept = [matrix[i][t] for i in range(len(matrix)) for t in _valid_positions(mask, i)]
    mean, std = _mean_std(kept)
    std = math.sqrt(std ** 2 + 1e-8)
    return [[(matrix[i][t] - mean) / std if mask[i, t] else 0.0 for t in range(mask.shape[1])]
            for i in range(len(matrix))]


def _per_row_on_mask(per_row, mask):
    return torch.tensor([[per_row[i] if mask[i, t] else 0.0 for t in range(mask.shape[1])]
                         for i in range(mask.shape[0])], dtype=torch.float64)


def _assert_close(actual, expected):
    torch.testing.assert_close(actual.double(), torch.as_tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5)


def _reference_gae(rewards, values, mask, gamma, lam):
    advantages = [[0.0] * LENGTH for _ in range(len(rewards))]
    returns = [[0.0] * LENGTH for _ in range(len(rewards))]
    for i in range(len(rewards)):
        next_value, running = 0.0, 0.0
        for t in reversed(_valid_positions(mask, i)):
            delta = rewards[i, t].item() + gamma * next_value - values[i, t].item()
            running = delta + gamma * lam * running
            advantages[i][t], returns[i][t] = running, running + values[i, t].item()
            next_value = values[i, t].item()
    return _whiten_over_mask(advantages, mask), returns


@pytest.mark.parametrize("interior_holes", [False, True])
def test_gae_matches_reference(interior_holes):
    rewards, values, mask, _ = _random_batch(0, interior_holes)
    advantages, returns = core_algos.compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    expected_advantages, expected_returns = _reference_gae(rewards, values, mask, 0.9, 0.8)
    _assert_close(advantages, expected_advantages)
    _assert_close(returns, expected_returns)


def test_gae_literal():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.5, 0.0]])
    advantages, returns = core_algos.compute_gae_advantage_return(rewards, values, torch.ones(1, 2), gamma=0.9, lam=0.8)
    # A1 = 1 - 0 = 1; A0 = (0 + 0.9 * 0 - 0.5) + 0.9 * 0.8 * 1 = 0.22; returns = A + V;
    # two values whiten to -+ 1/sqrt(2) (mean 0.61, sample std 0.39 * sqrt(2))
    _assert_close(returns, [[0.72, 1.0]])
    _assert_close(advantages, [[-1 / math.sqrt(2), 1 / math.sqrt(2)]])


def _reference_grpo(scores, uids, epsilon, norm_by_std):
    advantages = []
    for i in range(len(scores)):
        group = [scores[j] for j in _group_members(uids, i)]
        mean, std = _mean_std(group) if len(group) > 1 else (0.0, 1.0)
        advantages.append((scores[i] - mean) / (std + epsilon) if norm_by_std else scores[i] - mean)
    return advantages


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(norm_by_std):
    rewards, _, mask, uids = _random_batch(1)
    advantages, returns = core_algos.compute_grpo_outcome_advantage(rewards, mask, uids,
                                                                    norm_adv_by_std_in_grpo=norm_by_std)
    expected = _per_row_on_mask(_reference_grpo(_scores(rewards), uids, 1e-6, norm_by_std), mask)
    _assert_close(advantages, expected)
    _assert_close(returns, expected)
    assert torch.all(advantages[4:7] == 0)  # equal scores: 0, not NaN


def test_grpo_literal():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 2.0]])
    advantages, _ = core_algos.compute_grpo_outcome_advantage(rewards, torch.ones(5, 2),
                                                              np.array(["a", "a", "a", "a", "b"], dtype=object))
    # group a: scores 1, 0, 1, 0 -> mean 0.5, sample std sqrt(1/3); group b of one -> 2 / (1 + 1e-6)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    _assert_close(advantages[:, 0], [a, -a, a, -a, 2 / (1 + 1e-6)])


def _reference_passk(scores, uids, epsilon, norm_by_std):
    advantages = [0.0] * len(scores)
    for uid in dict.fromkeys(uids):
        members = [j for j in range(len(uids)) if uids[j] == uid]
        ranked = sorted(members, key=lambda j: -scores[j])
        margin = scores[ranked[0]] - scores[ranked[1]]
        if norm_by_std:
            margin /= _mean_std([scores[j] for j in members])[1] + epsilon
        advantages[ranked[0]] = margin
    return advantages


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk_matches_reference(norm_by_std):
    rewards, _, mask, uids = _random_batch(2)
    keep = [i for i in range(10) if uids[i] != "p1"]  # pass@k needs groups of two or more
    rewards, mask, uids = rewards[keep], mask[keep], uids[keep]
    advantages, _ = core_algos.compute_grpo_passk_outcome_advantage(rewards, mask, uids,
                                                                    norm_adv_by_std_in_grpo=norm_by_std)
    _assert_close(advantages, _per_row_on_mask(_reference_passk(_scores(rewards), uids, 1e-6, norm_by_std), mask))


def test_grpo_passk_literal_and_group_of_one_raises():
    rewards = torch.tensor([[1.0], [0.5], [0.0]])
    uids = np.array(["a", "a", "a"], dtype=object)
    raw, _ = core_algos.compute_grpo_passk_outcome_advantage(rewards, torch.ones(3, 1), uids,
                                                             norm_adv_by_std_in_grpo=False)
    normed, _ = core_algos.compute_grpo_passk_outcome_advantage(rewards, torch.ones(3, 1), uids)
    _assert_close(raw[:, 0], [0.5, 0.0, 0.0])
    _assert_close(normed[:, 0], [0.5 / (0.5 + 1e-6), 0.0, 0.0])
    with pytest.raises(ValueError, match="at least 2 samples"):
        core_algos.compute_grpo_passk_outcome_advantage(rewards, torch.ones(3, 1), np.array(["a", "a", "b"]))


def test_rloo_matches_reference():
    rewards, _, mask, uids = _random_batch(3)
    scores = _scores(rewards)
    expected = []
    for i in range(10):
        others = [scores[j] for j in _group_members(uids, i) if j != i]
        expected.append(scores[i] - math.fsum(others) / len(others) if others else scores[i])
    advantages, returns = core_algos.compute_rloo_outcome_advantage(rewards, mask, uids)
    _assert_close(advantages, _per_row_on_mask(expected, mask))
    _assert_close(returns, advantages)


def test_rloo_literal():
    advantages, _ = core_algos.compute_rloo_outcome_advantage(torch.tensor([[1.0], [0.0], [0.0], [3.0]]),
                                                              torch.ones(4, 1), np.array([7, 7, 7, 8]))
    _assert_close(advantages[:, 0], [1.0, -0.5, -0.5, 3.0])


@pytest.mark.parametrize("interior_holes", [False, True])
def test_reinforce_plus_plus_matches_reference(interior_holes):
    rewards, _, mask, _ = _random_batch(4, interior_holes)
    returns_ref = [[0.0] * LENGTH for _ in range(10)]
    for i in range(10):
        running = 0.0
        for t in reversed(_valid_positions(mask, i)):
            running = rewards[i, t].item() + 0.95 * running
            returns_ref[i][t] = running
    advantages, returns = core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.95)
    _assert_close(returns, returns_ref)
    _assert_close(advantages, _whiten_over_mask(returns_ref, mask))


def test_reinforce_plus_plus_baseline_matches_reference():
    rewards, _, mask, uids = _random_batch(5)
    scores = _scores(rewards)
    centred = []
    for i in range(10):
        group = [scores[j] for j in _group_members(uids, i)]
        centred.append(scores[i] - (math.fsum(group) / len(group) if len(group) > 1 else 0.0))
    expected = _whiten_over_mask([[centred[i]] * LENGTH for i in range(10)], mask)
    advantages, returns = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, uids)
    _assert_close(advantages, expected)
    _assert_close(returns, expected)


def test_remax_matches_reference_and_literal():
    rewards, _, mask, _ = _random_batch(6)
    baselines = torch.randn(10, generator=torch.Generator().manual_seed(60))
    expected_returns = [[math.fsum(rewards[i, s].item() for s in _valid_positions(mask, i) if s >= t)
                         if mask[i, t] else 0.0 for t in range(LENGTH)] for i in range(10)]
    expected_advantages = [[expected_returns[i][t] - baselines[i].item() if mask[i, t] else 0.0
                            for t in range(LENGTH)] for i in range(10)]
    advantages, returns = core_algos.compute_remax_outcome_advantage(rewards, baselines, mask)
    _assert_close(returns, expected_returns)
    _assert_close(advantages, expected_advantages)

    advantages, returns = core_algos.compute_remax_outcome_advantage(
        torch.tensor([[0.0, 0.0, 1.0, 0.0]]), torch.tensor([0.25]), torch.tensor([[1, 1, 1, 0]]))
    _assert_close(returns, [[1.0, 1.0, 1.0, 0.0]])
    _assert_close(advantages, [[0.75, 0.75, 0.75, 0.0]])


def test_opo_matches_reference_and_literal():
    rewards, _, mask, uids = _random_batch(7)
    scores = _scores(rewards)
    lengths = [len(_valid_positions(mask, i)) for i in range(10)]
    expected = []
    for i in range(10):
        members = _group_members(uids, i)
        baseline = 0.0
        if len(members) > 1:
            baseline = math.fsum(lengths[j] * scores[j] for j in members) / sum(lengths[j] for j in members)
        expected.append(scores[i] - baseline)
    advantages, returns = core_algos.compute_opo_outcome_advantage(rewards, mask, uids)
    _assert_close(advantages, _per_row_on_mask(expected, mask))

    advantages, _ = core_algos.compute_opo_outcome_advantage(
        torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([[1, 0, 0], [1, 1, 1]]), np.array(["u", "u"]))
    # baseline = (1 * 1 + 3 * 0) / (1 + 3) = 0.25
    _assert_close(advantages, [[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25]])


def test_outcome_estimators_reject_an_index_of_the_wrong_length():
    with pytest.raises(ValueError, match="index .* 2 entries but the batch has 3 rows"):
        core_algos.compute_grpo_outcome_advantage(torch.ones(3, 2), torch.ones(3, 2), np.array(["a", "b"]))


def test_uids_given_as_a_tensor_group_by_value():
    advantages, _ = core_algos.compute_rloo_outcome_advantage(torch.tensor([[1.0], [0.0], [3.0]]), torch.ones(3, 1),
                                                              torch.tensor([7, 7, 8]))
    _assert_close(advantages[:, 0], [1.0, -1.0, 3.0])
