"""GPU proof of the worker's mode switches with rollout.name=sglang and =vllm: what the trainer calls, in one process.

    ActorRolloutRefWorker.rollout_mode() -> generate_sequences -> trainer_mode() -> compute_log_prob

and the same with a LoRA actor, whose adapters the engine gets merged into its weights. Each test is parametrized by
engine (ids end in [sglang] or [vllm]); an engine's param skips when its package is
missing. The model is the random Qwen2.5-0.5B-shaped one of tests/gpu/test_engine_hybrid.py. vLLM allows one
in-process engine per process, as the trainer has: each vLLM param runs in a pytest process of its own
(own_process, tests/gpu/conftest.py). On the GPU machine, from the repository root:

    PYTHONPATH=.:/tmp/site python -m pytest tests/gpu/test_engine_worker.py -q -s -k sglang
    PYTHONPATH=.:/tmp/site-vllm:/tmp/site python -m pytest tests/gpu/test_engine_worker.py -q -s -k vllm
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.hybrid_engine import QWEN25_05B, random_prompts
from engine_params import ENGINE_OVERRIDES, PROMPT_LENGTH, importable_engine, policy_worker
from hybridrl.models.fsdp_utils import fsdp_root
from hybridrl.protocol import DataProto

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the hybrid engine needs CUDA")

MEAN_ABS_TOLERANCE = 0.02  # bf16 engine vs bf16 FSDP forward, per response token (as test_engine_hybrid)
# With LoRA the actor computes each adapter apart (x·W + (x·A)·B·s, each product rounded to bf16) and the engine
# multiplies by W + B·A·s rounded once: one more rounding between them. vLLM, H200, 2026-12-01: 0.0180 with the large
# adapter this test sets, 0.0074 after an update; the base model stays 0.71-0.76 away.
LORA_MEAN_ABS_TOLERANCE = 0.03
CACHE_RESET = {"sglang": "timing_s/flush_cache", "vllm": "timing_s/reset_prefix_cache"}  # rollout_mode's last part


@pytest.fixture(params=list(ENGINE_OVERRIDES))
def engine(request) -> str:
    return importable_engine(request)


def check_the_engine_gave_its_memory_back(engine: str, rollout, awake: dict, released: dict) -> None:
    """`awake`, `released`: the rollout's last_switch after generating in rollout mode and after trainer_mode."""
    if engine == "sglang":  # the memory saver's own gauge of the engine's memory: released < 5 % of awake
        engine_awake, engine_released = awake["rollout mode/engine"], released["trainer mode restored/engine"]
        print(f"engine {engine_awake:.2f} GiB awake, {engine_released:.2f} GiB released")
        assert engine_released < 0.05 * engine_awake
    else:  # vllm: the device's used memory fell by what waking took
        used_awake, used_asleep = awake["rollout mode/device_used"], released["trainer mode restored/device_used"]
        print(f"device used {used_awake:.2f} GiB awake, {used_asleep:.2f} GiB asleep")
        engine_bytes = sum(rollout.resume_bytes.values()) / (1 << 30)
        assert used_awake - used_asleep > 0.95 * engine_bytes  # sleep level 2 gave back what waking took


@pytest.mark.own_process("vllm")
def test_rollout_mode_pushes_the_weights_and_trainer_mode_releases_the_engine(engine, tmp_path_factory):
    worker = policy_worker(engine, tmp_path_factory, ["actor_rollout_ref.rollout.calculate_log_probs=true",
                                                      "actor_rollout_ref.rollout.multi_stage_wake_up=true"])
    try:
        prompts = random_prompts(8, PROMPT_LENGTH, QWEN25_05B["vocab_size"], seed=7, ragged=True)
        with pytest.raises(RuntimeError, match=r"call rollout_mode\(\) first"):
            worker.generate_sequences(prompts)

        to_rollout = worker.rollout_mode()
        output = worker.generate_sequences(prompts)
        awake = dict(worker.rollout.last_switch)
        to_trainer = worker.trainer_mode()
        released = dict(worker.rollout.last_switch)
        print(f"\nrollout_mode {to_rollout}\ntrainer_mode {to_trainer}")
        assert {"timing_s/resume_weights", "timing_s/update_weights", "timing_s/resume_kv_cache",
                CACHE_RESET[engine]} <= set(to_rollout)
        assert "timing_s/release_engine" in to_trainer
        check_the_engine_gave_its_memory_back(engine, worker.rollout, awake, released)

        # the engine generated from the pushed weights: its log-probs are the actor's
        batch = DataProto.from_dict(dict(output.batch))
        log_probs = worker.compute_log_prob(batch).batch["old_log_probs"]
        mask = batch.batch["response_mask"].bool()
        mean_abs = float((log_probs - batch.batch["rollout_log_probs"])[mask].abs().mean())
        print(f"mean |Δ log p| engine vs actor: {mean_abs:.4f}")
        assert mask.any() and mean_abs < MEAN_ABS_TOLERANCE

        # The same weights version again: the release dropped the weights (SGLang's memory saver drops the contents,
        # vLLM's sleep level 2 discards them), so they are pushed again.
        assert not worker.rollout.weights_survive_release
        again = worker.rollout_mode()
        worker.trainer_mode()
        assert "timing_s/update_weights" in again
    finally:
        worker.rollout.shutdown()


def move_lora_b(module, std: float, seed: int) -> int:
    """Set every LoRA B matrix (zero at init, so the adapted model starts as the base) to N(0, std²), in place: an
    adapter that changes the function about as much as the base weights' own spread. Returns how many were set.
    reshard() first: after a no-grad forward the FSDP2 root keeps its gathered bf16 copies registered."""
    root = fsdp_root(module)
    root.reshard()
    generator = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for name, parameter in root.named_parameters():
            if ".lora_B." in name:
                local = parameter.to_local()
                local.copy_(torch.randn(local.shape, generator=generator, dtype=local.dtype) * std)
                moved += 1
    return moved


def engine_against_actor_and_base(worker, output) -> tuple[float, float]:
    """mean |Δ log p| of the engine's sampled tokens against the LoRA actor and against its base model (the actor with
    its adapters disabled: the reference policy under LoRA)."""
    batch = DataProto.from_dict(dict(output.batch))
    mask = batch.batch["response_mask"].bool()
    assert mask.any()
    engine_log_probs = batch.batch["rollout_log_probs"]
    actor = worker.compute_log_prob(batch).batch["old_log_probs"]
    base = worker.compute_ref_log_prob(batch).batch["ref_log_prob"]
    return (float((actor - engine_log_probs)[mask].abs().mean()),
            float((base - engine_log_probs)[mask].abs().mean()))


@pytest.mark.own_process("vllm")
def test_a_lora_actor_reaches_the_engine_merged_before_and_after_an_update(engine, tmp_path_factory):
    """With model.lora_rank > 0 the engine knows nothing of LoRA: every adapted layer is pushed as W + B·A·scaling
    under its base name (fsdp_utils.iter_hf_weights). The engine's log-probs are the adapted actor's (within the bf16
    tolerance) and far from the base model's, after the first push and after a real LoRA update; the base weights
    do not move."""
    worker = policy_worker(engine, tmp_path_factory, [
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.rollout.calculate_log_probs=true"],
        role="actor_rollout_ref")
    try:
        assert move_lora_b(worker.actor_module, std=0.2, seed=3) == 24 * 7  # q k v o gate up down, 24 layers
        prompts = random_prompts(8, PROMPT_LENGTH, QWEN25_05B["vocab_size"], seed=7, ragged=True)
        worker.rollout_mode()
        output = worker.generate_sequences(prompts)
        worker.trainer_mode()
        to_actor, to_base = engine_against_actor_and_base(worker, output)
        print(f"\nLoRA, first push: engine vs actor mean |Δ| {to_actor:.4f}, vs base {to_base:.4f}")
        assert to_actor < LORA_MEAN_ABS_TOLERANCE and to_base > 5 * LORA_MEAN_ABS_TOLERANCE

        batch = DataProto.from_dict(dict(output.batch))
        scores = worker.compute_log_prob(batch).batch["old_log_probs"]
        base_before = worker.compute_ref_log_prob(batch).batch["ref_log_prob"]
        batch.union(DataProto.from_dict({"old_log_probs": scores, "ref_log_prob": base_before}))
        rows = batch.batch["responses"].shape[0]
        batch.batch["advantages"] = torch.linspace(-1, 1, rows).unsqueeze(-1) * batch.batch["response_mask"]
        worker.update_actor(batch)
        mask = batch.batch["response_mask"].bool()
        changed = float((worker.compute_log_prob(batch).batch["old_log_probs"] - scores)[mask].abs().mean())
        torch.testing.assert_close(worker.compute_ref_log_prob(batch).batch["ref_log_prob"], base_before,
                                   atol=1e-3, rtol=0)  # only the adapters train

        to_rollout = worker.rollout_mode()
        after = worker.generate_sequences(prompts)
        worker.trainer_mode()
        to_actor, to_base = engine_against_actor_and_base(worker, after)
        print(f"after one update (which moved the actor's log-probs by {changed:.4f}): engine vs actor mean |Δ| "
              f"{to_actor:.4f}, vs base {to_base:.4f}")
        assert "timing_s/update_weights" in to_rollout
        assert changed > 2 * LORA_MEAN_ABS_TOLERANCE  # an engine that kept the pre-update weights could not pass
        assert to_actor < LORA_MEAN_ABS_TOLERANCE and to_base > 5 * LORA_MEAN_ABS_TOLERANCE
    finally:
        worker.rollout.shutdown()
