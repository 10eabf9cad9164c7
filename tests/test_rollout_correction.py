"""Rollout-training mismatch correction (issue #16 point 4): weights, truncation, rejection, veto, metrics, wiring.

The numbers are hand computations on a 2-row batch whose per-token ratios pi_old / pi_rollout are chosen:
row 0 = [2, 0.5, 4] (3 tokens), row 1 = [1, 3] (2 tokens and one padding token whose log-probs are garbage).
The rollout's probability is 0.1 on every token, so pi_old = 0.1 * ratio.
"""
import math

import pytest
import torch

from hybridrl.algorithms.core_algos import get_policy_loss_fn
from hybridrl.algorithms.rollout_correction import (compute_rollout_correction_and_add_to_batch,
                                                    compute_rollout_correction_and_rejection_mask)
from hybridrl.config import compose_config, validate_config
from hybridrl.config.validation import ConfigError
from hybridrl.protocol import DataProto

RATIOS = [[2.0, 0.5, 4.0], [1.0, 3.0, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ROLLOUT_P = 0.1


def log_probs():
    rollout = torch.full((2, 3), math.log(ROLLOUT_P))
    old = torch.log(ROLLOUT_P * torch.tensor(RATIOS))
    old[1, 2], rollout[1, 2] = 100.0, -100.0  # padding: must change nothing
    return old, rollout, MASK.clone()


def correct(**settings):
    old, rollout, mask = log_probs()
    return compute_rollout_correction_and_rejection_mask(old, rollout, mask, **settings)


def test_token_is_weights_are_truncated_and_zero_at_padding():
    result = correct(rollout_is="token", rollout_is_threshold=2.0)
    torch.testing.assert_close(result.rollout_is_weights, torch.tensor([[2.0, 0.5, 2.0], [1.0, 2.0, 0.0]]))
    assert torch.equal(result.response_mask, MASK)  # IS alone rejects nothing
    m = result.metrics
    # statistics of the ratios before truncation: (2 + 0.5 + 4 + 1 + 3) / 5 tokens
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(2.1)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(4.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(2 / 5)  # 4 and 3 exceed 2
    assert m["rollout_corr/rollout_is_ratio_fraction_low"] == pytest.approx(0.0)  # 0.5 is not below 1/2
    # per-sequence mean weights: (2 + 0.5 + 4) / 3 and (1 + 3) / 2
    assert m["rollout_corr/rollout_is_seq_mean"] == pytest.approx((6.5 / 3 + 2.0) / 2)
    assert m["rollout_corr/rollout_is_seq_max_deviation"] == pytest.approx(6.5 / 3 - 1)
    # std / ESS on the ratios clamped to [0.5, 2]: [2, 0.5, 2, 1, 2], mean 1.5, E[w^2] = 13.25 / 5
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(math.sqrt(13.25 / 5 - 1.5 ** 2))
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.5 ** 2 / (13.25 / 5), rel=1e-6)


def test_sequence_is_weight_is_the_product_of_the_token_ratios():
    result = correct(rollout_is="sequence", rollout_is_threshold=3.5)
    # products: 2 * 0.5 * 4 = 4 (truncated to 3.5) and 1 * 3 = 3; every token of a row carries its row's weight
    torch.testing.assert_close(result.rollout_is_weights, torch.tensor([[3.5, 3.5, 3.5], [3.0, 3.0, 0.0]]))
    m = result.metrics
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(4.0)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(3.0)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # one sequence of two
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx((3 * 4.0 + 2 * 3.0) / 5)


@pytest.mark.parametrize("level, expected", [
    ("token", [[2.0, 0.5, 2.0], [1.0, 2.0, 0.0]]),       # token mean 7.5 / 5 = 1.5
    ("sequence", [[4.0, 4.0, 4.0], [3.0, 3.0, 0.0]])])   # sequence mean (4 + 3) / 2 = 3.5
def test_batch_normalize_divides_by_the_mean_weight(level, expected):
    threshold = 2.0 if level == "token" else 5.0
    result = correct(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=True)
    factor = 1.5 if level == "token" else 3.5
    torch.testing.assert_close(result.rollout_is_weights, torch.tensor(expected) / factor)
    assert result.metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor)


def test_token_rejection_masks_tokens_outside_the_thresholds():
    result = correct(rollout_rs="token", rollout_rs_threshold=2.5)  # lower: 1 / 2.5 = 0.4
    assert result.rollout_is_weights is None
    assert result.response_mask.tolist() == [[1, 1, 0], [1, 0, 0]]  # 4 and 3 exceed 2.5
    assert result.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 5)
    assert result.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)


def test_explicit_lower_threshold_rejects_low_ratios():
    result = correct(rollout_rs="token", rollout_rs_threshold=5.0, rollout_rs_threshold_lower=0.9)
    assert result.response_mask.tolist() == [[1, 0, 1], [1, 1, 0]]  # only 0.5 is below 0.9
    assert result.metrics["rollout_corr/rollout_rs_ratio_fraction_low"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("level, upper, kept_rows", [
    ("geometric", 1.6, [True, False]),  # geometric means 4 ** (1/3) = 1.587 and 3 ** (1/2) = 1.732
    ("sequence", 3.5, [False, True])])  # products 4 and 3
def test_sequence_level_rejection_drops_whole_sequences(level, upper, kept_rows):
    result = correct(rollout_rs=level, rollout_rs_threshold=upper)
    expected = [[int(kept_rows[0])] * 3, [int(kept_rows[1])] * 2 + [0]]
    assert result.response_mask.tolist() == expected
    assert result.metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    rejected_tokens = (3 if not kept_rows[0] else 0) + (2 if not kept_rows[1] else 0)
    assert result.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected_tokens / 5)


def test_veto_rejects_a_sequence_with_one_catastrophic_token():
    result = correct(rollout_token_veto_threshold=0.6)  # row 0 holds a ratio of 0.5
    assert result.response_mask.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert result.metrics["rollout_corr/rollout_is_veto_fraction"] == pytest.approx(0.5)
    assert result.metrics["rollout_corr/rollout_is_catastrophic_token_fraction"] == pytest.approx(1 / 5)


def test_is_weights_and_rejection_combine():
    result = correct(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=3.5)
    torch.testing.assert_close(result.rollout_is_weights, torch.tensor([[2.0, 0.5, 2.0], [1.0, 2.0, 0.0]]))
    assert result.response_mask.tolist() == [[1, 1, 0], [1, 1, 0]]  # only the 4 is rejected


def test_mismatch_metrics():
    m = correct().metrics  # nothing configured: metrics only, nothing changed
    log_ratios = [math.log(r) for r in (2.0, 0.5, 4.0, 1.0, 3.0)]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(log_ratios) / 5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(math.exp(x) - x - 1 for x in log_ratios) / 5)
    assert m["rollout_corr/chi2_token"] == pytest.approx((4 + 0.25 + 16 + 1 + 9) / 5 - 1)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((4.0 ** 2 + 3.0 ** 2) / 2 - 1)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(1 / ROLLOUT_P)
    training_ppl = [1 / ROLLOUT_P * 4.0 ** (-1 / 3), 1 / ROLLOUT_P * 3.0 ** (-1 / 2)]
    assert m["rollout_corr/training_ppl"] == pytest.approx(sum(training_ppl) / 2)
    log_ppl_diff = [-math.log(4.0) / 3, -math.log(3.0) / 2]  # mean log pi_rollout - mean log pi_old per row
    assert m["rollout_corr/log_ppl_diff"] == pytest.approx(sum(log_ppl_diff) / 2)
    assert m["rollout_corr/log_ppl_diff_max"] == pytest.approx(max(log_ppl_diff))
    assert m["rollout_corr/ppl_ratio"] == pytest.approx(sum(math.exp(d) for d in log_ppl_diff) / 2)
    assert m["rollout_corr/rollout_is_veto_fraction"] == 0.0


def test_a_long_sequence_cannot_overflow_and_still_counts_as_above_the_threshold():
    """50 tokens of ratio e: the product e^50 is bounded to e^20 for the weight, but compared unbounded."""
    rollout = torch.full((1, 50), -3.0)
    old = rollout + 1.0
    mask = torch.ones(1, 50, dtype=torch.long)
    result = compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_is="sequence",
                                                           rollout_is_threshold=2.0, rollout_rs="sequence",
                                                           rollout_rs_threshold=1e10)
    assert torch.equal(result.rollout_is_weights, torch.full((1, 50), 2.0))
    assert result.metrics["rollout_corr/rollout_is_max"] == pytest.approx(math.exp(20.0))
    assert result.response_mask.sum() == 0  # e^50 > 1e10 although the bounded e^20 is not
    assert all(math.isfinite(v) for v in result.metrics.values())


def test_add_to_batch_sets_the_mask_and_the_weights():
    old, rollout, mask = log_probs()
    batch = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    settings = validate_config(compose_config([
        "actor_rollout_ref.rollout.calculate_log_probs=true", "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token", "algorithm.rollout_correction.rollout_rs_threshold=3.5",
    ])).algorithm.rollout_correction
    metrics = compute_rollout_correction_and_add_to_batch(batch, settings)
    assert batch.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 0]]
    torch.testing.assert_close(batch.batch["rollout_is_weights"], torch.tensor([[2.0, 0.5, 2.0], [1.0, 2.0, 0.0]]))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "gpg", "kl_cov"])
def test_policy_losses_weigh_each_token(loss_mode):
    """At pi == pi_old the token loss is -A (gpg: -A log pi = A here, kl_cov: its penalty |log r| is 0); with
    weights w the token-mean loss is the mean of w * that over the 5 response tokens."""
    config = validate_config(compose_config([f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}"]))
    loss_fn = get_policy_loss_fn(loss_mode)
    log_prob = torch.full((2, 3), -1.0)
    advantages = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, 7.0]])
    weights = torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.25, 0.0]])
    weighted, _ = loss_fn(log_prob, log_prob, advantages, MASK, "token-mean", config.actor_rollout_ref.actor,
                          rollout_is_weights=weights)
    sign = 1.0 if loss_mode == "gpg" else -1.0
    expected = sign * (2.0 * 1.0 + 0.5 * -2.0 + 0.0 * 0.5 + 1.0 * 3.0 + 0.25 * 1.0) / 5
    assert float(weighted) == pytest.approx(expected, abs=1e-6)
    unweighted, _ = loss_fn(log_prob, log_prob, advantages, MASK, "token-mean", config.actor_rollout_ref.actor)
    assert float(unweighted) == pytest.approx(sign * (1.0 - 2.0 + 0.5 + 3.0 + 1.0) / 5, abs=1e-6)


# ---------------------------------------------------------------------- config

def problems_of(*overrides):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(list(overrides)))
    return error.value.problems


def test_correction_without_rollout_log_probs_is_refused_naming_the_key():
    problems = problems_of("algorithm.rollout_correction.rollout_is=token")
    assert any(p.startswith("actor_rollout_ref.rollout.calculate_log_probs: expected true")
               and "algorithm.rollout_correction.rollout_is='token'" in p for p in problems), problems


def test_rejection_needs_its_threshold_and_an_ordered_pair():
    problems = problems_of("actor_rollout_ref.rollout.calculate_log_probs=true",
                           "algorithm.rollout_correction.rollout_rs=geometric")
    assert any(p.startswith("algorithm.rollout_correction.rollout_rs_threshold: expected") for p in problems)
    problems = problems_of("actor_rollout_ref.rollout.calculate_log_probs=true",
                           "algorithm.rollout_correction.rollout_rs=token",
                           "algorithm.rollout_correction.rollout_rs_threshold=2.0",
                           "algorithm.rollout_correction.rollout_rs_threshold_lower=3.0")
    assert any(p.startswith("algorithm.rollout_correction.rollout_rs_threshold_lower: expected less") for p in problems)


def test_unknown_level_and_bypass_mode_are_refused():
    problems = problems_of("algorithm.rollout_correction.rollout_is=geometric",
                           "algorithm.rollout_correction.bypass_mode=true")
    assert any(p.startswith("algorithm.rollout_correction.rollout_is:") for p in problems), problems
    assert any(p.startswith("algorithm.rollout_correction.bypass_mode:") for p in problems), problems


def test_is_weights_need_a_policy_loss_that_takes_them(tmp_path):
    extension = tmp_path / "old_style_loss.py"
    extension.write_text(
        "from hybridrl.algorithms.core_algos import register_policy_loss\n"
        "@register_policy_loss('old_style_rc_test')\n"
        "def old_style(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode='token-mean', config=None):\n"
        "    raise AssertionError\n")
    problems = problems_of(f"extensions=[{extension}]",
                           "actor_rollout_ref.actor.policy_loss.loss_mode=old_style_rc_test",
                           "actor_rollout_ref.rollout.calculate_log_probs=true",
                           "algorithm.rollout_correction.rollout_is=token")
    assert any(p.startswith("actor_rollout_ref.actor.policy_loss.loss_mode: expected a policy loss taking "
                            "rollout_is_weights") for p in problems), problems


def test_an_invalid_threshold_is_reported_once_without_breaking_the_cross_key_rules():
    problems = problems_of("actor_rollout_ref.rollout.calculate_log_probs=true",
                           "algorithm.rollout_correction.rollout_rs=token",
                           "algorithm.rollout_correction.rollout_rs_threshold=-1",
                           "algorithm.rollout_correction.rollout_rs_threshold_lower=0.5")
    assert [p for p in problems if "rollout_correction" in p] == [
        "algorithm.rollout_correction.rollout_rs_threshold: expected > 0, got -1.0"], problems


# ---- verl >= 0.8's options (hybridrl.compat.verl.trainer.ppo.rollout_corr_helper): IcePop, divergence rejection

def log_ratio_and_mask():
    old, rollout, mask = log_probs()
    return old - rollout, mask  # the padding token's log ratio is 200: it must change nothing


def test_icepop_zeroes_the_weights_outside_its_bounds_and_reports_their_share():
    from hybridrl.algorithms.rollout_correction import compute_icepop_or_truncated_is_weights

    log_ratio, mask = log_ratio_and_mask()
    weights, m = compute_icepop_or_truncated_is_weights(log_ratio, mask, "token", "0.6_3.5")
    # ratios [2, 0.5, 4] and [1, 3]: 0.5 and 4 fall outside [0.6, 3.5]
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.0, 0.0], [1.0, 3.0, 0.0]]))
    assert m["rollout_is_oob_ratio"] == pytest.approx(2 / 5)
    # statistics of the weights as applied: mean 6 / 5, E[w^2] = 14 / 5
    assert m["rollout_is_mean"] == pytest.approx(1.2)
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(14 / 5 - 1.2 ** 2))
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1.2 ** 2 / (14 / 5), rel=1e-6)
    assert m["rollout_is_seq_fraction_high"] == pytest.approx(0.0)  # raw row means 6.5 / 3 and 2 are inside
    with pytest.raises(TypeError, match="not a boolean"):
        compute_icepop_or_truncated_is_weights(log_ratio, mask, "token", True)


@pytest.mark.parametrize("options, thresholds, kept, masked_fraction, seq_masked_fraction", [
    # k2 = (log rho)^2 / 2: [0.24, 0.24, 0.96], [0, 0.60]; at most 0.5 kept
    ("token_k2", "0.5", [[1, 1, 0], [1, 0, 0]], 2 / 5, 1.0),
    # k1 = -log rho, row means -log(4) / 3 = -0.46 and -log(3) / 2 = -0.55; kept within [log 0.6, log 1.5]
    ("seq_mean_k1", "0.6_1.5", [[1, 1, 1], [0, 0, 0]], 2 / 5, 1 / 2),
    # k3 = rho - 1 - log rho, row maxima 4 - 1 - log 4 = 1.61 and 3 - 1 - log 3 = 0.90; at most 1 kept
    ("seq_max_k3", "1.0", [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2),
    # both: a token stays only where both keep it
    ("token_k2,seq_max_k3", "0.5,1.0", [[0, 0, 0], [1, 0, 0]], 4 / 5, 1.0),
])
def test_divergence_rejection_keeps_what_every_option_keeps(options, thresholds, kept, masked_fraction,
                                                            seq_masked_fraction):
    from hybridrl.algorithms.rollout_correction import compute_divergence_rejection_mask

    log_ratio, mask = log_ratio_and_mask()
    keep, m = compute_divergence_rejection_mask(log_ratio, mask, options, thresholds)
    assert (keep & mask.bool()).int().tolist() == kept
    assert m["rollout_rs_masked_fraction"] == pytest.approx(masked_fraction)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(seq_masked_fraction)


def test_divergence_rejection_statistics_and_threshold_errors():
    from hybridrl.algorithms.rollout_correction import compute_divergence_rejection_mask

    log_ratio, mask = log_ratio_and_mask()
    _, m = compute_divergence_rejection_mask(log_ratio, mask, "seq_mean_k1", "0.6_1.5")
    # each token carries its row's mean: (3 * -log(4) / 3 + 2 * -log(3) / 2) / 5
    assert m["rollout_rs_seq_mean_k1_mean"] == pytest.approx(-math.log(12) / 5)
    assert m["rollout_rs_seq_mean_k1_seq_min"] == pytest.approx(-math.log(3) / 2)
    assert m["rollout_rs_seq_mean_k1_fraction_low"] == pytest.approx(1 / 2)  # row 1 is below log 0.6
    with pytest.raises(ValueError, match="only k1 options take 'lower_upper'"):
        compute_divergence_rejection_mask(log_ratio, mask, "token_k3", "0.5_2")
    with pytest.raises(ValueError, match=r"one threshold for all of \['token_k1', 'seq_max_k2'\] or one each"):
        compute_divergence_rejection_mask(log_ratio, mask, "token_k1,seq_max_k2", "1.5,2,3")
    with pytest.raises(ValueError, match="options must be from"):
        compute_divergence_rejection_mask(log_ratio, mask, "geometric", "2")
