"""The run length reaches the workers as an argument (trainer -> ActorRolloutRefWorker / CriticWorker
total_training_steps), never by writing into the validated config: their LR schedules span exactly it.
Real workers in this process (one gloo rank), a tiny model."""

import pytest

from hybridrl.config import compose_config, validate_config
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.models.spec import critic_model_spec, policy_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker
from hybridrl.workers.critic import CriticWorker

LR = 0.01
COSINE = ["warmup_style=cosine", "lr_warmup_steps_ratio=0.5", "min_lr_ratio=0.0", f"lr={LR}"]


def lrs(scheduler, steps):
    values = []
    for _ in range(steps):
        values.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return values


def test_the_workers_lr_schedules_span_the_run_length_they_are_given(tmp_path, in_process_rank):
    tokenizer = build_tokenizer(["one two three four five"] * 20, vocab_size=64)
    model_dir = build_tiny_model(str(tmp_path / "model"), tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                                 num_kv_heads=1, intermediate_size=32)
    config = validate_config(compose_config(
        ["data.train_files=x.parquet", "data.val_files=x.parquet", f"actor_rollout_ref.model.path={model_dir}",
         f"critic.model.path={model_dir}", "critic.enable=true", "data.train_batch_size=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.ppo_mini_batch_size=2",
         *[f"actor_rollout_ref.actor.optim.{o}" for o in COSINE], *[f"critic.optim.{o}" for o in COSINE]]))
    actor = ActorRolloutRefWorker(config.actor_rollout_ref, policy_model_spec(config),
                                  role="actor", device="cpu", total_training_steps=4)
    actor.init_model()
    critic = CriticWorker(config.critic, critic_model_spec(config), rollout_n=1, device="cpu", total_training_steps=4)
    critic.init_model()
    # 4 steps: warmup over 2 (0.5 x 4), then half a cosine down to 0 at step 4
    expected = [0.0, LR / 2, LR, LR / 2, 0.0]
    assert lrs(actor.actor_lr_scheduler, 5) == pytest.approx(expected, abs=1e-12)
    assert lrs(critic.critic_lr_scheduler, 5) == pytest.approx(expected, abs=1e-12)
    assert config.actor_rollout_ref.actor.optim.total_training_steps == -1  # nothing wrote the run length there
    assert config.critic.optim.total_training_steps == -1
