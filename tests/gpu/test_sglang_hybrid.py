"""GPU proof of the hybrid engine: an FSDP2 actor and a colocated SGLang engine in one process, on one GPU.

Run on the GPU machine from the repository root (sglang importable, e.g. PYTHONPATH=.:/tmp/site):

    python -m pytest tests/gpu -q

The model is the Qwen2.5-0.5B architecture with random weights (benchmarks/hybrid_engine.py builds
it, the process group, the actor and the hybrid engine exactly as the benchmark does). One engine
serves every test of this module; the last test kills its scheduler on purpose.
"""
from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the hybrid engine needs CUDA", allow_module_level=True)
pytest.importorskip("sglang")

from benchmarks.hybrid_engine import (EOS_ID, PAD_ID, QWEN25_05B, build_actor, build_hybrid,  # noqa: E402
                                      hybrid_config, init_single_gpu_process_group, make_qwen05b_model,
                                      offloading_switch, random_prompts, rollout_window, train_step)
from hybridrl.algorithms.core_algos import compute_advantage  # noqa: E402
from hybridrl.workers.rollout.engine_io import EngineDiedError, EngineMemoryError  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 64, 64
VOCAB = QWEN25_05B["vocab_size"]
MEAN_ABS_TOLERANCE, KL_TOLERANCE = 0.02, 1e-3  # bf16 engine vs bf16 FSDP forward, per response token
GiB = 1 << 30


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    model_dir = make_qwen05b_model(os.environ.get("HYBRIDRL_GPU_MODEL_DIR") or str(tmp_path_factory.mktemp("q05")))
    init_single_gpu_process_group()
    config = hybrid_config(model_dir, [
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.multi_stage_wake_up=true",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        # the 20-step loop's batches: 8 groups x n=4 = one mini-batch of 32 rows
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        # prefill CUDA graphs only shorten the engine start here; decode graphs stay on
        "+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_prefill_cuda_graph=true",
    ])
    module, optimizer, actor = build_actor(config)
    rollout, switch = build_hybrid(config, module)
    yield SimpleNamespace(config=config, module=module, optimizer=optimizer, actor=actor, rollout=rollout,
                          switch=switch)
    rollout.shutdown()


def fsdp_log_probs(hybrid, output, temperature: float = 1.0) -> torch.Tensor:
    """The FSDP actor's recomputed log-probs of the rollout's response tokens (trainer mode)."""
    data = output.select(["input_ids", "attention_mask", "position_ids", "responses"])
    data.meta_info["temperature"] = temperature
    log_probs, _ = hybrid.actor.compute_log_prob(data)
    return log_probs


def disagreement(rollout_log_probs, fsdp_log_probs_, response_mask) -> tuple[float, float]:
    """mean |Δ log p| and the k3 estimate of KL(rollout || fsdp) over the response tokens."""
    delta = (fsdp_log_probs_ - rollout_log_probs)[response_mask.bool()]
    return float(delta.abs().mean()), float((delta.exp() - delta - 1).mean())


def perturb(module, scale: float, seed: int) -> list[torch.Tensor]:
    """Replace every sharded (fp32 master) parameter p by (p + scale·N(0,1)) rescaled to p's norm, in place.

    A large change of the function at unchanged weight magnitudes (bf16 rounding stays as before).
    Returns the original tensors, to undo it. reshard() first: after a no-grad forward the FSDP2
    root keeps its gathered bf16 copies registered.
    """
    module.reshard()
    generator = torch.Generator(device="cuda").manual_seed(seed)
    originals = []
    with torch.no_grad():
        for parameter in module.parameters():
            local = parameter.to_local()
            originals.append(local.clone())
            changed = local + torch.randn(local.shape, generator=generator, device=local.device,
                                          dtype=local.dtype) * scale
            local.copy_(changed * (local.norm() / changed.norm()))
    return originals


def undo(module, originals: list[torch.Tensor]) -> None:
    module.reshard()
    with torch.no_grad():
        for parameter, original in zip(module.parameters(), originals):
            parameter.to_local().copy_(original)


def test_layout_matches_the_hf_rollout_and_generation_stops_at_eos(hybrid):
    prompts = random_prompts(8, PROMPT_LENGTH, VOCAB, seed=1, ragged=True)
    prompts.meta_info["validate"] = True  # val_kwargs: greedy
    with rollout_window(hybrid.switch):
        first = hybrid.rollout.generate_sequences(prompts)
        stop_token = int(first.batch["responses"][0, 4])  # make row 0's 5th greedy token the EOS
        hybrid.rollout.flush_cache()  # a radix-cache hit may change near-tied greedy choices of random weights
        relabelled = prompts.select()
        relabelled.meta_info["eos_token_id"] = [stop_token]
        stopped = hybrid.rollout.generate_sequences(relabelled)

    batch = first.batch
    assert batch["prompts"].shape == (8, PROMPT_LENGTH) and batch["responses"].shape == (8, RESPONSE_LENGTH)
    assert torch.equal(batch["prompts"], prompts.batch["input_ids"])
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], dim=1))
    assert torch.equal(batch["attention_mask"],
                       torch.cat([prompts.batch["attention_mask"], batch["response_mask"]], dim=1))
    last_prompt_position = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(batch["position_ids"][:, PROMPT_LENGTH:],
                       last_prompt_position + torch.arange(1, RESPONSE_LENGTH + 1))
    assert batch["rollout_log_probs"].shape == (8, RESPONSE_LENGTH)

    # Every row stops right after its first stop token, or runs to the full length without one.
    for row in range(8):
        length = int(stopped.batch["response_mask"][row].sum())
        tokens = stopped.batch["responses"][row].tolist()
        assert stopped.batch["response_mask"][row, :length].all() and not stopped.batch["response_mask"][row, length:].any()
        assert stop_token not in tokens[:length - 1], f"row {row} went on past the stop token"
        # (the engine also stops at the model's own EOS, from its config)
        assert length == RESPONSE_LENGTH or tokens[length - 1] in (stop_token, EOS_ID), f"row {row} stopped early"
        assert all(token == PAD_ID for token in tokens[length:])
        assert (stopped.batch["rollout_log_probs"][row, length:] == 0).all()
    # Row 0 decodes exactly as before up to the stop token (same weights, greedy, same batch until then).
    hits = [index for index, token in enumerate(batch["responses"][0].tolist()) if token == stop_token]
    length = int(stopped.batch["response_mask"][0].sum())
    assert length == hits[0] + 1 <= 5
    assert stopped.batch["responses"][0, :length].tolist() == batch["responses"][0, :length].tolist()


def test_synced_weights_give_the_fsdp_log_probs_also_after_a_large_weight_change(hybrid):
    prompts = random_prompts(32, PROMPT_LENGTH, VOCAB, seed=2, ragged=True)
    with rollout_window(hybrid.switch):
        before = hybrid.rollout.generate_sequences(prompts)
    mean_abs, kl = disagreement(before.batch["rollout_log_probs"], fsdp_log_probs(hybrid, before),
                                before.batch["response_mask"])
    print(f"\nsync agreement, initial weights: mean|Δ| {mean_abs:.4f}, KL {kl:.2e}")
    assert mean_abs < MEAN_ABS_TOLERANCE and kl < KL_TOLERANCE

    originals = perturb(hybrid.module, scale=0.02, seed=3)
    with rollout_window(hybrid.switch):
        after = hybrid.rollout.generate_sequences(prompts)
    new_weights = fsdp_log_probs(hybrid, after)
    mean_abs, kl = disagreement(after.batch["rollout_log_probs"], new_weights, after.batch["response_mask"])
    undo(hybrid.module, originals)
    old_weights_change = disagreement(fsdp_log_probs(hybrid, after), new_weights, after.batch["response_mask"])[0]
    print(f"sync agreement after the change: mean|Δ| {mean_abs:.4f}, KL {kl:.2e}; "
          f"the change itself moves log-probs by {old_weights_change:.3f}")
    assert mean_abs < MEAN_ABS_TOLERANCE and kl < KL_TOLERANCE
    assert old_weights_change > 10 * MEAN_ABS_TOLERANCE  # a sync that did nothing could not pass


def test_release_frees_the_engine_and_offload_round_trips_the_fsdp_state(hybrid):
    train_step(hybrid.module, hybrid.optimizer)  # create the Adam state the offload must move
    with rollout_window(hybrid.switch):
        awake = hybrid.rollout.last_switch["rollout mode/engine"]
    released = hybrid.rollout.last_switch["trainer mode restored/engine"]
    print(f"\nengine GPU memory awake {awake:.2f} GiB, released {released:.2f} GiB ({released / awake:.1%})")
    assert released < 0.05 * awake

    prompts = random_prompts(16, PROMPT_LENGTH, VOCAB, seed=4)
    with rollout_window(hybrid.switch):
        reference = hybrid.rollout.generate_sequences(prompts)
    scores_before = fsdp_log_probs(hybrid, reference)
    offload = offloading_switch(hybrid.module, hybrid.optimizer, hybrid.rollout)
    trainer_allocated = torch.cuda.memory_allocated()
    with rollout_window(offload):
        rollout_allocated = torch.cuda.memory_allocated()
        output = hybrid.rollout.generate_sequences(prompts)
    params = sum(p.numel() for p in hybrid.module.parameters())
    freed = trainer_allocated - rollout_allocated
    print(f"offload freed {freed / GiB:.2f} GiB for {params / 1e6:.0f} M fp32 params + Adam; "
          f"switch timings {hybrid.rollout.last_switch}")
    assert freed >= 0.95 * params * 4 * 3  # fp32 master weights + two Adam moments
    assert torch.equal(fsdp_log_probs(hybrid, reference), scores_before)  # the state came back intact
    mean_abs, kl = disagreement(output.batch["rollout_log_probs"], fsdp_log_probs(hybrid, output),
                                output.batch["response_mask"])
    assert mean_abs < MEAN_ABS_TOLERANCE and kl < KL_TOLERANCE


def test_twenty_grpo_steps_keep_memory_flat_and_every_sync_exact(hybrid):
    groups, n = 8, 4
    trainer_memory, agreements = [], []
    for step in range(20):
        prompts = random_prompts(groups, PROMPT_LENGTH, VOCAB, seed=100 + step, ragged=True).repeat(n, interleave=True)
        with rollout_window(hybrid.switch):
            data = hybrid.rollout.generate_sequences(prompts)
        trainer_memory.append((hybrid.rollout.last_switch["trainer mode restored/device_used"],
                               torch.cuda.memory_allocated() / GiB))
        old_log_probs = fsdp_log_probs(hybrid, data)
        agreements.append(disagreement(data.batch["rollout_log_probs"], old_log_probs, data.batch["response_mask"]))
        # reward: the share of even token ids in the response (a learnable, dense-enough signal)
        responses, mask = data.batch["responses"], data.batch["response_mask"]
        scores = ((responses % 2 == 0) & mask.bool()).sum(1) / mask.sum(1)
        rewards = torch.zeros(responses.shape, dtype=torch.float32)
        rewards[torch.arange(len(rewards)), mask.sum(1) - 1] = scores.float()
        data.batch["token_level_rewards"] = rewards
        data.non_tensor_batch["uid"] = np.repeat(np.arange(groups), n)
        compute_advantage(data, "grpo")
        data.batch["old_log_probs"] = old_log_probs
        data.meta_info["temperature"] = 1.0
        hybrid.actor.update_policy(data)
    print("\nstep, mean|Δ|, KL, device used GiB, allocated GiB")
    for step, ((mean_abs, kl), (used, allocated)) in enumerate(zip(agreements, trainer_memory)):
        print(f"{step:2d} {mean_abs:.4f} {kl:.2e} {used:.2f} {allocated:.2f}")
    assert all(mean_abs < MEAN_ABS_TOLERANCE and kl < KL_TOLERANCE for mean_abs, kl in agreements)
    used = [used for used, _ in trainer_memory[2:]]  # from step 2 the Adam state and allocator pools exist
    allocated = [allocated for _, allocated in trainer_memory[2:]]
    assert max(used) - min(used) < 0.5 and max(allocated) - min(allocated) < 0.1


def test_a_resume_that_cannot_fit_fails_at_once_with_the_numbers_and_keys(hybrid):
    """Before the engine resumes, the switch checks the device has room; short of it, EngineMemoryError names
    the need, what is free and the keys to change, and the engine is left released and alive (not killed by a
    CUDA OOM in its scheduler, the old failure)."""
    weights, rest = hybrid.rollout.resume_bytes["weights"], hybrid.rollout.resume_bytes["kv_cache+cuda_graph"]
    assert weights > 0.9 * GiB and rest > weights  # measured at start: 0.5B bf16 weights, then the KV cache
    torch.cuda.empty_cache()
    # room for the weights, not for the KV cache: the second stage of the multi-stage wake-up must refuse
    hog = torch.empty(torch.cuda.mem_get_info()[0] - weights - rest // 2, dtype=torch.uint8, device="cuda")
    started = time.perf_counter()
    with pytest.raises(EngineMemoryError) as error:
        with rollout_window(hybrid.switch):
            pass
    message = str(error.value)
    print(f"refused in {time.perf_counter() - started:.2f} s: {message}")
    assert time.perf_counter() - started < 10
    for key in ("gpu_memory_utilization", "ppo_max_token_len_per_gpu", "param_offload", "GiB"):
        assert key in message
    assert hybrid.rollout.awake_tags == set()  # what did resume was given back
    del hog
    torch.cuda.empty_cache()
    with rollout_window(hybrid.switch):  # the engine is alive and resumes once there is room
        output = hybrid.rollout.generate_sequences(random_prompts(4, PROMPT_LENGTH, VOCAB))
    assert output.batch["response_mask"].sum() > 0


def test_a_killed_scheduler_fails_the_step_within_60_s_naming_the_cause(hybrid):
    """Runs last: it kills the module's engine."""
    scheduler_pid = next(process.pid for name, process in hybrid.rollout.monitor.processes if "scheduler" in name)
    prompts = random_prompts(64, PROMPT_LENGTH, VOCAB, seed=5)
    started = time.perf_counter()
    with pytest.raises(EngineDiedError, match=r"scheduler.*exit code -9"):
        with rollout_window(hybrid.switch):
            os.kill(scheduler_pid, signal.SIGKILL)
            hybrid.rollout.generate_sequences(prompts)
    elapsed = time.perf_counter() - started
    print(f"\nEngineDiedError after {elapsed:.1f} s")
    assert elapsed < 60
    with pytest.raises(EngineDiedError):  # later calls fail at once, too
        hybrid.rollout.flush_cache()
