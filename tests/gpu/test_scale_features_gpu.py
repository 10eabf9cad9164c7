"""Scale features on the GPU path in one process (world size 1, NCCL, bf16 compute over fp32 master weights):
use_dynamic_bsz + use_remove_padding + LoRA against the plain padded worker, and the GPU memory that
param_offload + optimizer_offload free between phases. The CPU tests
(tests/test_scale_features*.py) prove exact equality in fp32; here bf16 makes them close, not equal.

Run on the GPU machine from the repository root:  python -m pytest tests/gpu/test_scale_features_gpu.py -q
"""
from __future__ import annotations

import gc

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


from hybridrl.config.compose import compose_config  # noqa: E402
from hybridrl.config.validation import validate_config  # noqa: E402
from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.defaults.tiny_model import build_tiny_model  # noqa: E402
from hybridrl.models.spec import critic_model_spec, policy_model_spec  # noqa: E402
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402
from hybridrl.workers.critic import CriticWorker  # noqa: E402
from tiny_gpu import PROMPT_LENGTH, RESPONSE_LENGTH, generate, prompts, single_gpu_tiny_model  # noqa: E402

SCALE = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=48",
         "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.lora_rank=8",
         "actor_rollout_ref.model.lora_alpha=16", "critic.model.use_remove_padding=true",
         "critic.ppo_max_token_len_per_gpu=48", "critic.model.lora_rank=8"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    yield from single_gpu_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def config(model_dir, *overrides):
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=x.parquet", "data.val_files=x.parquet",
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.use_kl_loss=true", "trainer.n_gpus_per_node=1", "algorithm=gae",
        "actor_rollout_ref.rollout.n=1", *overrides]))


def policy_worker(cfg, **kwargs):
    """The policy worker of `cfg`, with the ModelSpec the controller would resolve."""
    return ActorRolloutRefWorker(cfg.actor_rollout_ref, policy_model_spec(cfg), **kwargs)


def critic_worker(cfg, **kwargs):
    return CriticWorker(cfg.critic, critic_model_spec(cfg), **kwargs)



def test_dynamic_bsz_remove_padding_and_lora_on_gpu(setup):
    model_dir, tokenizer = setup
    plain = policy_worker(config(model_dir), role="actor_rollout_ref", seed=1, device="cuda")
    plain.init_model()
    scale = policy_worker(config(model_dir, *SCALE), role="actor_rollout_ref", seed=1, device="cuda")
    scale.init_model()
    batch = DataProto.from_dict(dict(generate(scale, prompts(tokenizer)).batch))
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

    critic_plain = critic_worker(config(model_dir), rollout_n=1, seed=1, device="cuda")
    critic_plain.init_model()
    critic = critic_worker(config(model_dir, *SCALE), rollout_n=1, seed=1, device="cuda")
    critic.init_model()
    values = critic.compute_values(batch).batch["values"]
    assert (values - critic_plain.compute_values(batch).batch["values"])[mask].abs().mean() < 0.05
    batch.union(DataProto.from_dict({"values": values}))
    batch.batch["returns"] = batch.batch["response_mask"].float()
    losses = [critic.update_critic(batch).meta_info["metrics"]["critic/vf_loss"][0] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[2] < losses[0]


# ---------------------------------------------------------------------- param_offload / optimizer_offload

OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.param_offload=true",
           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"]


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def update_batch(rows: int, vocab_size: int) -> DataProto:
    """Random prompt + response tokens, every position attended, random advantages."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(4, vocab_size, (rows, PROMPT_LENGTH + RESPONSE_LENGTH), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.ones(rows, RESPONSE_LENGTH, dtype=torch.long)
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": attention_mask,
        "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
        "responses": input_ids[:, PROMPT_LENGTH:], "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=generator) * response_mask})


def test_param_and_optimizer_offload_free_the_gpu_between_phases(setup, tmp_path):
    """Trainer mode between phases (after an update): the offloaded actor holds neither its fp32 parameters (nor
    their gradients) nor AdamW's moments on the GPU. A model of 25 M parameters, so the state is hundreds of MB
    and the allocator's own few MB do not matter."""
    _, tokenizer = setup
    model_dir = build_tiny_model(str(tmp_path / "mid"), tokenizer, hidden_size=768, num_layers=4, num_heads=12,
                                 num_kv_heads=4, intermediate_size=2048)
    batch = update_batch(4, len(tokenizer))
    memory = ["actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.use_kl_loss=false",
              "actor_rollout_ref.actor.optim.lr=1e-3"]
    workers, held = {}, {}
    gc.collect()  # the earlier tests' workers: freed now, not in the middle of a measurement
    for name, overrides in (("plain", []), ("offload", OFFLOAD)):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        worker = policy_worker(config(model_dir, *memory, *overrides), role="actor", seed=1, device="cuda")
        worker.init_model()
        if "old_log_probs" not in batch.batch.keys():
            batch.batch["old_log_probs"] = worker.compute_log_prob(batch).batch["old_log_probs"]
        worker.update_actor(batch)
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
        workers[name] = worker

    plain, offloaded = workers["plain"], workers["offload"]
    param_bytes = sum(local(p).numel() * local(p).element_size() for p in plain.actor_module.parameters())
    adam_bytes = sum(local(value).numel() * local(value).element_size()
                     for state in plain.actor_optimizer.state.values() for value in state.values() if value.dim() > 0)
    freed = held["plain"] - held["offload"]
    print(f"\nheld between phases: plain {held['plain'] / 2**20:.1f} MiB, offloaded {held['offload'] / 2**20:.1f} MiB; "
          f"params {param_bytes / 2**20:.1f} MiB + Adam {adam_bytes / 2**20:.1f} MiB")
    assert param_bytes > 90 * 2**20 and adam_bytes == 2 * param_bytes
    assert freed >= 0.9 * (param_bytes + adam_bytes)

    # where the offloaded actor's state is between phases, and during one
    parameters = list(offloaded.actor_module.parameters())
    states = [offloaded.actor_optimizer.state[p] for p in parameters]
    moments = [local(state[key]) for state in states for key in ("exp_avg", "exp_avg_sq")]
    assert all(local(p).device.type == "cpu" and p.grad is None for p in parameters)
    assert all(moment.device.type == "cpu" and moment.is_pinned() for moment in moments)
    assert all(state["step"].device.type == "cpu" for state in states)
    with offloaded.actor_offload.loaded(optimizer=True):
        assert all(local(p).device.type == "cuda" for p in offloaded.actor_module.parameters())
        assert all(local(state[key]).device.type == "cuda" for state in states for key in ("exp_avg", "exp_avg_sq"))
        assert all(state["step"].device.type == "cpu" for state in states)  # AdamW's counter stays on the CPU

    # and it computes what the plain actor computes (bf16 with non-deterministic kernels: close, not bit-equal)
    mask = batch.batch["response_mask"].bool()
    plain_log_probs = plain.compute_log_prob(batch).batch["old_log_probs"]
    offloaded_log_probs = offloaded.compute_log_prob(batch).batch["old_log_probs"]
    update_effect = (plain_log_probs - batch.batch["old_log_probs"])[mask].abs().mean()
    assert update_effect > 1e-3
    assert (offloaded_log_probs - plain_log_probs)[mask].abs().mean() < 0.1 * update_effect


# ---------------------------------------------------------------------- use_fused_kernels

from benchmarks.fused_logprob import fused_log_probs, make_inputs, peak_bytes, plain_log_probs, run_step  # noqa: E402

FUSED = "actor_rollout_ref.model.use_fused_kernels=true"


def test_fused_log_probs_hold_less_than_half_the_memory_of_the_plain_path():
    """8192 response tokens through Qwen2.5-0.5B's output layer (vocab 151936, hidden 896) in bf16: log-probs and
    entropy into a loss, backward into hidden and weight (benchmarks/fused_logprob.py prints the whole table)."""
    tokens, vocab, hidden_size = 8192, 151936, 896
    inputs = make_inputs(tokens, vocab, hidden_size, torch.bfloat16, "cuda")
    peaks, results = {}, {}
    for name, path in (("plain", plain_log_probs), ("fused", fused_log_probs)):
        def step(name=name, path=path):
            results[name] = run_step(path, *inputs, backward=True)
        peaks[name] = peak_bytes(step, "cuda")
    print(f"\npeak above inputs: plain {peaks['plain'] / 2**30:.2f} GiB, fused {peaks['fused'] / 2**30:.2f} GiB")
    assert peaks["plain"] > tokens * vocab * 4  # the plain path holds float32 logits: the comparison means something
    assert peaks["fused"] < 0.5 * peaks["plain"]

    (log_probs, entropy, grad_hidden, grad_weight), plain = results["fused"], results["plain"]
    # bf16: the plain path rounds logits / temperature to bf16, the fused one divides in float32
    assert (log_probs - plain[0]).abs().mean() < 0.01 and (entropy - plain[1]).abs().mean() < 0.01
    for grad, plain_grad in ((grad_hidden, plain[2]), (grad_weight, plain[3])):
        assert (grad.float() - plain_grad.float()).norm() < 0.02 * plain_grad.float().norm()


def test_fused_kernels_worker_matches_the_plain_worker_on_gpu(setup):
    """FSDP2 with bf16 compute: the output weight is the gathered bf16 one inside the root's forward. Generation
    (HF generate on the same module) is untouched; log-probs, ref log-probs and one update track the plain worker."""
    model_dir, tokenizer = setup
    plain = policy_worker(config(model_dir), role="actor", seed=1, device="cuda")
    plain.init_model()
    fused = policy_worker(config(model_dir, FUSED), role="actor_rollout_ref", seed=1, device="cuda")
    fused.init_model()
    assert fused.actor.use_fused_kernels and fused.ref_policy.use_fused_kernels
    batch = DataProto.from_dict(dict(generate(fused, prompts(tokenizer)).batch))
    mask = batch.batch["response_mask"].bool()
    assert mask.sum() > 8

    old_plain = plain.compute_log_prob(batch).batch["old_log_probs"]
    old_fused = fused.compute_log_prob(batch).batch["old_log_probs"]
    ref_log_probs = fused.compute_ref_log_prob(batch).batch["ref_log_prob"]
    assert (old_fused - old_plain)[mask].abs().mean() < 0.02
    assert (ref_log_probs - old_plain)[mask].abs().mean() < 0.02

    batch.union(DataProto.from_dict({"old_log_probs": old_plain, "ref_log_prob": ref_log_probs}))
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.batch["response_mask"]
    plain_metrics = plain.update_actor(batch).meta_info["metrics"]
    fused_metrics = fused.update_actor(batch).meta_info["metrics"]
    assert all(torch.isfinite(torch.tensor(v)).all() for v in fused_metrics.values())
    assert fused_metrics["actor/grad_norm"][0] == pytest.approx(plain_metrics["actor/grad_norm"][0], rel=0.05)
    assert fused_metrics["actor/pg_loss"][0] == pytest.approx(plain_metrics["actor/pg_loss"][0], abs=0.02)
    after = fused.compute_log_prob(batch).batch["old_log_probs"]
    assert (after - old_fused)[mask].abs().max() > 1e-3, "the fused update did not change the policy"


# ---------------------------------------------------------------------- liger-kernel

LIGER = "actor_rollout_ref.model.use_liger=true"


def test_liger_kernels_keep_the_model_function_and_gradients(setup):
    """apply_liger swaps RMSNorm / RoPE / SwiGLU for liger's Triton kernels in place: in fp32 the swapped model
    computes the same logits and parameter gradients as the HF one (Triton's fp32 math, not bit-identical)."""
    pytest.importorskip("liger_kernel")
    from hybridrl.models.fsdp_utils import apply_liger, load_hf_model

    model_dir, tokenizer = setup
    input_ids = prompts(tokenizer).batch["input_ids"].cuda()
    results = {}
    for name in ("hf", "liger"):
        model = load_hf_model(model_dir, dtype=torch.float32).cuda()
        if name == "liger":
            apply_liger(model)
            assert model.model.norm._get_name() == "LigerRMSNorm", model.model.norm  # swapped in place
        logits = model(input_ids=input_ids).logits
        logits.logsumexp(-1).mean().backward()
        results[name] = (logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()})
    (hf_logits, hf_grads), (liger_logits, liger_grads) = results["hf"], results["liger"]
    assert (liger_logits - hf_logits).abs().max() < 1e-3
    for name, grad in hf_grads.items():
        assert (liger_grads[name] - grad).norm() <= 1e-3 * grad.norm() + 1e-6, name


def test_liger_worker_matches_the_plain_worker_on_gpu(setup):
    """use_liger through the worker (FSDP2, bf16 compute): log-probs and one update track the plain worker."""
    pytest.importorskip("liger_kernel")
    model_dir, tokenizer = setup
    plain = policy_worker(config(model_dir), role="actor_rollout", seed=1, device="cuda")
    plain.init_model()
    liger = policy_worker(config(model_dir, LIGER), role="actor", seed=1, device="cuda")
    liger.init_model()
    batch = DataProto.from_dict(dict(generate(plain, prompts(tokenizer)).batch))
    mask = batch.batch["response_mask"].bool()
    old_plain = plain.compute_log_prob(batch).batch["old_log_probs"]
    old_liger = liger.compute_log_prob(batch).batch["old_log_probs"]
    assert (old_liger - old_plain)[mask].abs().mean() < 0.02
    batch.union(DataProto.from_dict({"old_log_probs": old_plain}))
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.batch["response_mask"]
    batch.batch["ref_log_prob"] = old_plain
    plain_metrics = plain.update_actor(batch).meta_info["metrics"]
    liger_metrics = liger.update_actor(batch).meta_info["metrics"]
    assert liger_metrics["actor/grad_norm"][0] == pytest.approx(plain_metrics["actor/grad_norm"][0], rel=0.05)


# ---------------------------------------------------------------------- fsdp_config.forward_prefetch

@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_forward_prefetch_changes_when_layers_are_gathered_not_the_numbers(setup, strategy):
    """On one GPU the all-gathers are local, but the prefetch path (FSDP2 set_modules_to_forward_prefetch, FSDP1
    forward_prefetch) still runs with CUDA streams: the log-probs and one update must equal the plain worker's."""
    model_dir, tokenizer = setup
    workers = []
    for prefetch in ("false", "true"):
        worker = policy_worker(config(model_dir, f"actor_rollout_ref.actor.strategy={strategy}",
                                      f"actor_rollout_ref.actor.fsdp_config.forward_prefetch={prefetch}",
                                      "actor_rollout_ref.actor.use_kl_loss=false"), role="actor", seed=1, device="cuda")
        worker.init_model()
        workers.append(worker)
    batch = update_batch(4, len(tokenizer))
    plain, prefetching = (worker.compute_log_prob(batch).batch["old_log_probs"] for worker in workers)
    torch.testing.assert_close(prefetching, plain, atol=0, rtol=0)
    batch.union(DataProto.from_dict({"old_log_probs": plain}))
    plain_metrics, prefetch_metrics = (worker.update_actor(batch).meta_info["metrics"] for worker in workers)
    assert prefetch_metrics["actor/pg_loss"] == plain_metrics["actor/pg_loss"]
    plain_after, prefetch_after = (worker.compute_log_prob(batch).batch["old_log_probs"] for worker in workers)
    torch.testing.assert_close(prefetch_after, plain_after, atol=0, rtol=0)
