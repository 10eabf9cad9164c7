"""GPU proof of the worker's mode switches with rollout.name=sglang and =vllm: what the trainer calls, in one process.

    ActorRolloutRefWorker.rollout_mode() -> generate_sequences -> trainer_mode() -> compute_log_prob

One test parametrized by engine (ids end in [sglang] or [vllm]); an engine's param skips when its package is
missing. The model is the random Qwen2.5-0.5B-shaped one of tests/gpu/test_engine_hybrid.py. Run each engine in its
own pytest process, on the GPU machine from the repository root: one in-process vLLM engine per process is what the
trainer does (test_engine_hybrid.py's vLLM half starts another), and the SGLang param ran after the hybrid module's
SGLang engine was shut down.

    PYTHONPATH=.:/tmp/site python -m pytest tests/gpu/test_engine_worker.py -q -s -k sglang
    PYTHONPATH=.:/tmp/site-vllm:/tmp/site python -m pytest tests/gpu/test_engine_worker.py -q -s -k vllm
"""
from __future__ import annotations

import os

import pytest
import torch

from benchmarks.hybrid_engine import (QWEN25_05B, hybrid_config, init_single_gpu_process_group, make_qwen05b_model,
                                      random_prompts)
from hybridrl.protocol import DataProto
from hybridrl.models.spec import policy_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the hybrid engine needs CUDA")

PROMPT_LENGTH, RESPONSE_LENGTH = 64, 64
MEAN_ABS_TOLERANCE = 0.02  # bf16 engine vs bf16 FSDP forward, per response token (as test_engine_hybrid)

# Per engine (also the package its param imports): the config keys only it gets, and the timing key of the cache
# reset that ends rollout_mode.
ENGINES = {
    # prefill CUDA graphs only shorten the engine start here; decode graphs stay on
    "sglang": dict(overrides=["+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_prefill_cuda_graph=true"],
                   cache_reset="timing_s/flush_cache"),
    "vllm": dict(overrides=["actor_rollout_ref.rollout.gpu_memory_utilization=0.4"],
                 cache_reset="timing_s/reset_prefix_cache"),
}


@pytest.fixture(params=list(ENGINES))
def engine(request) -> str:
    pytest.importorskip(request.param)
    return request.param


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


def test_rollout_mode_pushes_the_weights_and_trainer_mode_releases_the_engine(engine, tmp_path_factory):
    model_dir = make_qwen05b_model(os.environ.get("HYBRIDRL_GPU_MODEL_DIR") or str(tmp_path_factory.mktemp("q05w")))
    init_single_gpu_process_group()
    config = hybrid_config(model_dir, [
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.multi_stage_wake_up=true",
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", *ENGINES[engine]["overrides"]], engine=engine)
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, policy_model_spec(config),
                                   role="actor_rollout", seed=1, device="cuda")
    worker.init_model()
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
                ENGINES[engine]["cache_reset"]} <= set(to_rollout)
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
