"""Scale features on the GPU path in one process (world size 1, NCCL, bf16 compute over fp32 master weights):
use_dynamic_bsz + use_remove_padding + LoRA against the plain padded worker. The CPU tests
(tests/test_scale_features*.py) prove exact equality in fp32; here bf16 makes them close, not equal.

Run on the GPU machine from the repository root:  python -m pytest tests/gpu/test_scale_features_gpu.py -q
"""
from __future__ import annotations

import os
import socket

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from hybridrl.config.compose import compose_config  # noqa: E402
from hybridrl.config.validation import validate_config  # noqa: E402
from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.utils.tiny_model import build_tiny_model, build_tokenizer  # noqa: E402
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from hybridrl.workers.critic import CriticWorker  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 8, 16
TEXTS = ["what is 12 plus 7 ? the answer is 19", "count to five : 1 2 3 4 5", "the cat sat on the mat",
         "seven times six is 42"]
SCALE = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=48",
         "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.lora_rank=8",
         "actor_rollout_ref.model.lora_alpha=16", "critic.model.use_remove_padding=true",
         "critic.ppo_max_token_len_per_gpu=48", "critic.model.lora_rank=8"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tokenizer = build_tokenizer(TEXTS * 20, vocab_size=128)
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny")), tokenizer, hidden_size=64)
    yield model_dir, tokenizer
    if dist.is_initialized():
        dist.destroy_process_group()


def config(model_dir, *overrides):
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=x.parquet", "data.val_files=x.parquet",
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.use_kl_loss=true", "trainer.n_gpus_per_node=1", "algorithm=gae", *overrides]))


def prompts(tokenizer):
    encoded = tokenizer(TEXTS, padding="max_length", max_length=PROMPT_LENGTH, truncation=True, return_tensors="pt")
    mask = encoded["attention_mask"]
    return DataProto.from_dict({"input_ids": encoded["input_ids"], "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
                               meta_info={"eos_token_id": tokenizer.eos_token_id,
                                          "pad_token_id": tokenizer.pad_token_id, "validate": False})


def test_dynamic_bsz_remove_padding_and_lora_on_gpu(setup):
    model_dir, tokenizer = setup
    plain = ActorRolloutRefWorker(config(model_dir).actor_rollout_ref, role="actor_rollout_ref", seed=1,
                                  device="cuda")
    plain.init_model()
    scale = ActorRolloutRefWorker(config(model_dir, *SCALE).actor_rollout_ref, role="actor_rollout_ref", seed=1,
                                  device="cuda")
    scale.init_model()
    batch = DataProto.from_dict(dict(scale.generate_sequences(prompts(tokenizer)).batch))
    mask = batch.batch["response_mask"].bool()
    assert mask.sum() > 8

    plain_log_probs = plain.compute_log_prob(batch).batch["old_log_probs"]
    scale_log_probs = scale.compute_log_prob(batch).batch["old_log_probs"]
    ref_before = scale.compute_ref_log_prob(batch).batch["ref_log_prob"]
    # bf16: packed vs padded attention and the LoRA (B = 0) path are close, not equal
    assert (scale_log_probs - plain_log_probs)[mask].abs().mean() < 0.05
    assert (ref_before - plain_log_probs)[mask].abs().mean() < 0.05

    batch.union(DataProto.from_dict({"old_log_probs": scale_log_probs, "ref_log_prob": ref_before}))
    batch.batch["advantages"] = torch.linspace(-1, 1, 4).unsqueeze(-1) * batch.batch["response_mask"]
    metrics = scale.update_actor(batch).meta_info["metrics"]
    assert all(torch.isfinite(torch.tensor(v)).all() for v in metrics.values())
    after = scale.compute_log_prob(batch).batch["old_log_probs"]
    assert (after - scale_log_probs)[mask].abs().max() > 1e-3, "the LoRA update did not change the policy"
    torch.testing.assert_close(scale.compute_ref_log_prob(batch).batch["ref_log_prob"], ref_before, atol=1e-3, rtol=0)

    critic_plain = CriticWorker(config(model_dir).critic, rollout_n=1, seed=1, device="cuda")
    critic_plain.init_model()
    critic = CriticWorker(config(model_dir, *SCALE).critic, rollout_n=1, seed=1, device="cuda")
    critic.init_model()
    values = critic.compute_values(batch).batch["values"]
    assert (values - critic_plain.compute_values(batch).batch["values"])[mask].abs().mean() < 0.05
    batch.union(DataProto.from_dict({"values": values}))
    batch.batch["returns"] = batch.batch["response_mask"].float()
    losses = [critic.update_critic(batch).meta_info["metrics"]["critic/vf_loss"][0] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[0]
