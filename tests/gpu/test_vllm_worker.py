"""GPU proof of the worker's mode switches with rollout.name=vllm: what the trainer calls, in one process.

    ActorRolloutRefWorker.rollout_mode() -> generate_sequences -> trainer_mode() -> compute_log_prob

Run on the GPU machine from the repository root, in its own pytest process (one in-process vLLM engine per
process is what the trainer does; tests/gpu/test_vllm_rollout.py starts another):

    PYTHONPATH=.:/tmp/site-vllm:/tmp/site python -m pytest tests/gpu/test_vllm_worker.py -q -s
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("the hybrid engine needs CUDA", allow_module_level=True)
pytest.importorskip("vllm")

from benchmarks.hybrid_engine import (QWEN25_05B, hybrid_config, init_single_gpu_process_group,  # noqa: E402
                                      make_qwen05b_model, random_prompts)
from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker  # noqa: E402

PROMPT_LENGTH, RESPONSE_LENGTH = 64, 64
MEAN_ABS_TOLERANCE = 0.02  # bf16 engine vs bf16 FSDP forward, per response token


def test_rollout_mode_pushes_the_weights_and_trainer_mode_puts_the_engine_to_sleep(tmp_path_factory):
    model_dir = make_qwen05b_model(os.environ.get("HYBRIDRL_GPU_MODEL_DIR") or str(tmp_path_factory.mktemp("q05w")))
    init_single_gpu_process_group()
    config = hybrid_config(model_dir, [
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.calculate_log_probs=true", "actor_rollout_ref.rollout.multi_stage_wake_up=true",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"], engine="vllm")
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor_rollout", seed=1, device="cuda")
    worker.init_model()
    try:
        prompts = random_prompts(8, PROMPT_LENGTH, QWEN25_05B["vocab_size"], seed=7, ragged=True)
        with pytest.raises(RuntimeError, match=r"call rollout_mode\(\) first"):
            worker.generate_sequences(prompts)

        to_rollout = worker.rollout_mode()
        output = worker.generate_sequences(prompts)
        used_awake = worker.rollout.last_switch["rollout mode/device_used"]
        to_trainer = worker.trainer_mode()
        used_asleep = worker.rollout.last_switch["trainer mode restored/device_used"]
        print(f"\nrollout_mode {to_rollout}\ntrainer_mode {to_trainer}\n"
              f"device used {used_awake:.2f} GiB awake, {used_asleep:.2f} GiB asleep")
        assert {"timing_s/resume_weights", "timing_s/update_weights", "timing_s/resume_kv_cache",
                "timing_s/reset_prefix_cache"} <= set(to_rollout)
        assert "timing_s/release_engine" in to_trainer
        engine_bytes = sum(worker.rollout.resume_bytes.values()) / (1 << 30)
        assert used_awake - used_asleep > 0.95 * engine_bytes  # sleep level 2 gave back what waking took

        # the engine generated from the pushed weights: its log-probs are the actor's
        batch = DataProto.from_dict(dict(output.batch))
        log_probs = worker.compute_log_prob(batch).batch["old_log_probs"]
        mask = batch.batch["response_mask"].bool()
        mean_abs = float((log_probs - batch.batch["rollout_log_probs"])[mask].abs().mean())
        print(f"mean |Δ log p| engine vs actor: {mean_abs:.4f}")
        assert mask.any() and mean_abs < MEAN_ABS_TOLERANCE

        # The same weights version again: sleep level 2 discarded them, so they are pushed again.
        assert not worker.rollout.weights_survive_release
        again = worker.rollout_mode()
        worker.trainer_mode()
        assert "timing_s/update_weights" in again
    finally:
        worker.rollout.shutdown()
