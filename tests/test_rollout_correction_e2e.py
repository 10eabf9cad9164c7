"""Rollout correction in a real CPU run (2 gloo ranks, HF rollout with calculate_log_probs, the toy task).

The HF rollout scores its tokens with the same fp32 weights as the trainer, so its log-probs match the
trainer's to rounding. A user rollout class makes a known mismatch instead: it lowers the reported log-prob
of every response's FIRST token by 1, i.e. that token's ratio pi_old / pi_rollout becomes e (x the tiny
natural mismatch). With token-level IS truncated at 2 and token-level rejection above 2.5, every first token
must then be rejected (response_mask 0) and weighted 2, every other token weighted ~1 — in the batch the
actor is updated on — and the run must still train.
"""
import math

import pytest
import torch

from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from tests.test_async_rollout import spy_on_update_actor
from tests.test_e2e_training import assert_weights_changed, make_config, probe_batch, read_metrics

SKEWED_ROLLOUT_FILE = '''
from hybridrl.workers.rollout.hf_rollout import HFRollout

class FirstTokenSkewedRollout(HFRollout):
    def generate_sequences(self, prompts):
        out = super().generate_sequences(prompts)
        out.batch["rollout_log_probs"][:, 0] -= 1.0
        return out
'''


@pytest.mark.slow
def test_token_is_and_rejection_reach_the_actor_and_the_run_trains(ray_local, toy_task, tmp_path):
    rollout_file = tmp_path / "skewed_rollout.py"
    rollout_file.write_text(SKEWED_ROLLOUT_FILE)
    run_dir = str(tmp_path / "run")
    config = make_config(toy_task, run_dir, "algorithm.adv_estimator=grpo",
                         "actor_rollout_ref.rollout.calculate_log_probs=true",
                         f"actor_rollout_ref.rollout.custom_cls.path={rollout_file}",
                         "actor_rollout_ref.rollout.custom_cls.name=FirstTokenSkewedRollout",
                         "algorithm.rollout_correction.rollout_is=token",
                         "algorithm.rollout_correction.rollout_is_threshold=2.0",
                         "algorithm.rollout_correction.rollout_rs=token",
                         "algorithm.rollout_correction.rollout_rs_threshold=2.5")
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        batches = spy_on_update_actor(trainer)
        probe = probe_batch(trainer)
        before = trainer.actor_rollout_wg.compute_log_prob(probe).batch["old_log_probs"]
        trainer.fit()
        after = trainer.actor_rollout_wg.compute_log_prob(probe).batch["old_log_probs"]
    finally:
        trainer.shutdown()

    assert len(batches) == 2
    for batch in batches:
        mask, weights = batch.batch["response_mask"], batch.batch["rollout_is_weights"]
        attention = batch.batch["attention_mask"][:, -mask.shape[1]:]
        assert mask[:, 0].sum() == 0, "the first tokens (ratio ~e > 2.5) were not rejected"
        assert torch.equal(mask[:, 1:], attention[:, 1:])  # every other generated token is kept
        torch.testing.assert_close(weights[:, 0], torch.full_like(weights[:, 0], 2.0))  # e truncated to 2
        rest = weights[:, 1:][attention[:, 1:].bool()]
        assert (rest - 1.0).abs().max() < 0.05, "same-weight tokens should have IS weight ~1"
        assert weights[~attention.bool()].abs().sum() == 0  # no weight on padding
        assert batch.batch["advantages"][:, 0].abs().sum() == 0  # rejected: no advantage, no loss

    for step in read_metrics(run_dir)[:2]:
        tokens = step["response_length/mean"] * 16  # 8 prompts x 2 responses, all lengths counted
        assert step["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(16 / tokens, rel=1e-4)
        assert step["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
        assert step["rollout_corr/rollout_is_max"] == pytest.approx(math.e, rel=0.05)
        # kl = mean(log pi_rollout - log pi_old) ~ -1 on one token of each response, ~0 elsewhere
        assert step["rollout_corr/kl"] == pytest.approx(-16 / tokens, abs=0.02)
    assert_weights_changed(before, after)
