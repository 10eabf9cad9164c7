"""End-to-end runs of the scale features: real local Ray, 2 gloo ranks, the toy task of test_e2e_training.py
(tiny random Qwen2, 8-token responses, 2 steps). Independent features share a run to keep CI short:

  packed  GAE + KL loss with use_dynamic_bsz, use_remove_padding and balance_batch (actor, ref and critic),
          a LoRA critic, the dapo manager with its overlong buffer, and a scorer that raises on every
          even-index prompt
  rm_lora the reward-model worker as the only reward (the rule scorer returns 0) and a LoRA GRPO policy
          whose reference is the base model under its adapters
"""
import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from test_e2e_training import COMMON_KEYS, assert_finite_keys, make_config, probe_batch, read_metrics

SCORERS = '''
def raising_on_even_index(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 2 == 0:
        raise ValueError("a scorer bug on purpose")
    text = solution_str.replace(" ", "")
    return text.count("a") / max(len(text), 1)


def zero(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
'''


@pytest.fixture(scope="module")
def scorers(tmp_path_factory):
    path = tmp_path_factory.mktemp("scorers") / "scorers.py"
    path.write_text(SCORERS)
    return str(path)


def run_with_probe(config):
    """Train; return the trainer, and the policy's and the reference's log-probs of one fixed batch before and
    after (with its response mask)."""
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        probe = probe_batch(trainer)
        before = trainer.actor_rollout_wg.compute_log_prob(probe).batch["old_log_probs"]
        trainer.fit()
        after = trainer.actor_rollout_wg.compute_log_prob(probe).batch["old_log_probs"]
        ref_after = trainer.actor_rollout_wg.compute_ref_log_prob(probe).batch["ref_log_prob"]
    finally:
        trainer.shutdown()
    return trainer, probe.batch["response_mask"], before, after, ref_after


@pytest.mark.slow
def test_dynamic_bsz_remove_padding_balance_batch_dapo_and_a_raising_scorer(ray_local, toy_task, scorers, tmp_path):
    config = make_config(
        toy_task, str(tmp_path), "algorithm=gae", "critic.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
        "actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true",
        "critic.ppo_max_token_len_per_gpu=64", "critic.model.lora_rank=4", "trainer.balance_batch=true",
        f"custom_reward_function.path={scorers}", "custom_reward_function.name=raising_on_even_index",
        "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=1.0",
        "reward_model.overlong_buffer.log=true", "data.shuffle=false", "trainer.test_freq=2",
        "data.train_max_samples=24", "data.val_max_samples=6")
    assert config.critic.use_dynamic_bsz and config.actor_rollout_ref.ref.log_prob_use_dynamic_bsz
    trainer, mask, before, after, _ = run_with_probe(config)
    assert len(trainer.train_dataloader.dataset) == 24 and len(trainer.val_dataloader.dataset) == 6
    steps = read_metrics(str(tmp_path))
    assert [m["step"] for m in steps] == [1, 2]
    balance_keys = ["seqlen_balance/min_partition", "seqlen_balance/max_partition",
                    "seqlen_balance/imbalance_before", "seqlen_balance/imbalance_after"]
    for m in steps:
        assert_finite_keys(m, COMMON_KEYS + balance_keys + ["critic/vf_loss", "actor/kl_loss", "timing_s/ref",
                                                             "timing_s/values", "reward/overlong_reward/mean"])
        assert m["seqlen_balance/imbalance_after"] <= m["seqlen_balance/imbalance_before"]
        assert m["seqlen_balance/min_partition"] <= m["seqlen_balance/max_partition"]
        # data.shuffle=false: each batch holds 4 even-index prompts x rollout.n=2 responses whose scorer raised
        assert m["reward/errors"] == 8.0
        assert -1.0 <= m["reward/overlong_reward/mean"] <= 0.0 and 0.0 <= m["reward/overlong/mean"] <= 1.0
    assert steps[1]["val-aux/reward/errors"] == 3.0  # validation: prompts 0..5 (val_max_samples), one response each
    assert (mask * (after - before)).abs().max() > 1e-4, "no update landed"


def save_reward_model(out_dir, tokenizer):
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(3)
    Qwen2ForSequenceClassification(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)



def score_at_last_token(rm, ids: torch.Tensor) -> float:
    """The reward model's score of one unpadded sequence (1 x length) at its last token, where the worker (like
    verl's) reads it. Not `rm(ids).logits`: HF's sequence-classification pooling takes the last token that is not the
    pad id, and a sampled response can end in the pad id (a flaky mismatch, 2026-12-06)."""
    with torch.no_grad():
        return rm.score(rm.model(input_ids=ids).last_hidden_state)[0, -1, 0].item()

@pytest.mark.slow
def test_reward_model_worker_and_lora_grpo(ray_local, toy_task, scorers, tmp_path):
    rm_dir = save_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(toy_task["model"]))
    run_dir = str(tmp_path / "run")
    config = make_config(
        toy_task, run_dir, "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.optim.lr=1e-2", "reward_model.enable=true", f"reward_model.model.path={rm_dir}",
        "reward_model.micro_batch_size_per_gpu=4", f"custom_reward_function.path={scorers}",
        "custom_reward_function.name=zero")
    _, mask, before, after, ref_after = run_with_probe(config)
    for m in read_metrics(run_dir):
        assert_finite_keys(m, COMMON_KEYS + ["actor/kl_loss", "timing_s/ref", "timing_s/reward"])
        # the rule scorer gives 0, so every score is the reward model's (different for different responses)
        assert m["critic/score/max"] > m["critic/score/min"]
        assert m["reward/errors"] == 0.0
    assert (mask * (after - before)).abs().max() > 1e-4, "the LoRA update did not change the policy"
    # The reference is the base model under the adapters: still the step-0 policy (B started at 0), so the
    # base weights did not move.
    assert torch.allclose(mask * ref_after, mask * before, atol=1e-5)
