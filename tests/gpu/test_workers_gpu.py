"""The workers' GPU path in one process (world size 1, NCCL): bf16 compute over fp32 master weights.

Run on the GPU machine from the repository root:  python -m pytest tests/gpu/test_workers_gpu.py -q
Same code as the CPU tests (tests/test_workers.py); here the device is cuda, so FSDP gathers bf16
parameters, reduces gradients in fp32 and the reference policy is held in bf16.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hybridrl.config.compose import compose_config  # noqa: E402
from hybridrl.config.validation import validate_config  # noqa: E402
from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.models.fsdp_utils import iter_full_state_dict  # noqa: E402
from hybridrl.algorithms.torch_functional import logprobs_from_logits  # noqa: E402
from hybridrl.models.spec import critic_model_spec, policy_model_spec  # noqa: E402
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from hybridrl.workers.critic import CriticWorker  # noqa: E402
from tiny_gpu import PROMPT_LENGTH, RESPONSE_LENGTH, generate, prompts, single_gpu_tiny_model  # noqa: E402



@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from single_gpu_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def config(model_dir, *overrides):
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=x.parquet", "data.val_files=x.parquet",
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.rollout.n=1", "trainer.n_gpus_per_node=1",
        *overrides]))



def fp32_reference(model_dir, weights, batch, temperature):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = model(**{k: batch.batch[k].cuda() for k in ("input_ids", "attention_mask", "position_ids")}).logits
    return logprobs_from_logits(logits[:, -RESPONSE_LENGTH - 1:-1] / temperature, batch.batch["responses"].cuda()).cpu()


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_actor_rollout_ref_on_gpu(setup, strategy):
    model_dir, tokenizer = setup
    cfg = config(model_dir, f"actor_rollout_ref.actor.strategy={strategy}")
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, policy_model_spec(cfg),
                                   role="actor_rollout_ref", seed=1, device="cuda")
    worker.init_model()
    master = next(worker.actor_module.parameters())
    assert master.device.type == "cuda" and master.dtype == torch.float32
    if strategy == "fsdp2":
        assert isinstance(master, DTensor)

    greedy = generate(worker, prompts(tokenizer, validate=True)).batch["responses"]
    assert greedy.shape == (4, RESPONSE_LENGTH)
    assert greedy.equal(generate(worker, prompts(tokenizer, validate=True)).batch["responses"])

    batch = DataProto.from_dict(dict(generate(worker, prompts(tokenizer, validate=False)).batch))
    batch.union(worker.compute_log_prob(batch))
    batch.union(worker.compute_ref_log_prob(batch))
    weights = {k: v.cpu() for k, v in iter_full_state_dict(worker.actor_module, torch.float32)}
    reference = fp32_reference(model_dir, weights, batch, cfg.actor_rollout_ref.rollout.temperature)
    mask = batch.batch["response_mask"].bool()
    # bf16 compute against an fp32 forward: close, not equal
    assert (batch.batch["old_log_probs"] - reference)[mask].abs().mean() < 0.05
    torch.testing.assert_close(batch.batch["ref_log_prob"], batch.batch["old_log_probs"], atol=0.1, rtol=0)

    batch.batch["advantages"] = torch.linspace(-1, 1, 4).unsqueeze(-1) * batch.batch["response_mask"]
    metrics = worker.update_actor(batch).meta_info["metrics"]
    assert all(torch.isfinite(torch.tensor(v)).all() for v in metrics.values())
    after = {k: v.cpu() for k, v in iter_full_state_dict(worker.actor_module, torch.float32)}
    assert max((after[k] - weights[k]).abs().max().item() for k in weights) > 1e-4


def test_critic_on_gpu(setup):
    model_dir, tokenizer = setup
    cfg = config(model_dir, "algorithm=gae", "critic.optim.lr=3e-3")
    actor = ActorRolloutRefWorker(cfg.actor_rollout_ref, policy_model_spec(cfg), role="rollout", seed=1, device="cuda")
    actor.init_model()
    batch = DataProto.from_dict(dict(generate(actor, prompts(tokenizer, validate=True)).batch))
    critic = CriticWorker(cfg.critic, critic_model_spec(cfg), rollout_n=1, seed=1, device="cuda")
    critic.init_model()
    batch.union(critic.compute_values(batch))
    batch.batch["returns"] = batch.batch["response_mask"].float()
    losses = [critic.update_critic(batch).meta_info["metrics"]["critic/vf_loss"][0] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[0]
