"""GPU: disaggregated placement on 2 GPUs (1 trainer + 1 SGLang rollout), weights over NCCL into SGLang's
weight-update group (`init_weights_update_group` / `update_weights_from_distributed`), one-step-off (issue 16).

    python -m pytest tests/gpu/test_async_training_gpu.py -q -s

A tiny random Qwen2 (head_dim 32: triton attention) and the toy task of tests/test_e2e_training.py, through
`python -m hybridrl.main_ppo`. With rollout.calculate_log_probs the engine reports the log-probs of what it sampled:
- synchronous schedule on separate pools: the engine holds the trainer's weights after every update, so its
  probabilities match the trainer's to bf16 noise (a stale or half-loaded model would be off by far more, lr 1e-2);
- one_step_off: samples are exactly one version old from step 2 on, and the engine's probabilities then differ.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)
pytest.importorskip("sglang")

from tiny_gpu import BF16_NOISE, check_engine_follows_trainer, run_toy_task, write_toy_task  # noqa: E402

STEPS = 4
SEPARATE_POOLS = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.mode=async",
                  "data.return_raw_chat=true", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return write_toy_task(str(tmp_path_factory.mktemp("toy")))


def run(task, run_dir, *overrides) -> list[dict]:
    return run_toy_task(task, run_dir, *SEPARATE_POOLS, *overrides, steps=STEPS)


def test_nccl_weight_sync_gives_the_engine_the_trainers_weights(task, tmp_path):
    steps = run(task, tmp_path / "sync")
    assert len(steps) == STEPS
    check_engine_follows_trainer(steps, "NCCL sync", shown=("timing_s/sync_weights", "weight_sync/megabytes"))
    assert all(step["weight_sync/megabytes"] > 0 for step in steps[1:])


def test_one_step_off_on_two_gpus(task, tmp_path):
    steps = run(task, tmp_path / "one_step_off", "async_training.mode=one_step_off")
    assert [step["async_training/staleness/max"] for step in steps] == [0] + [1] * (STEPS - 1)
    assert [step["async_training/staleness/min"] for step in steps] == [0] + [1] * (STEPS - 1)
    assert steps[0]["training/rollout_probs_diff_mean"] < BF16_NOISE
    for step in steps:
        print(f"step {int(step['training/global_step'])}: step {step['timing_s/step']:.2f} s, wait_gen "
              f"{step['timing_s/wait_gen']:.2f} s, sync {step['timing_s/sync_weights']:.3f} s", flush=True)


def test_a_tensor_parallel_engine_on_the_rollout_pool_gets_the_trainers_weights_over_nccl(tmp_path):
    """1 trainer GPU + a rollout pool of 2 GPUs holding one SGLang engine at tensor_model_parallel_size=2: its two TP
    workers join the weight-transfer group as members 1 and 2 (tensor_parallel.init_weights_update_group), the
    group's first rank serves it, and after every sync the engine's probabilities are the trainer's."""
    if torch.cuda.device_count() < 3:
        pytest.skip("needs 3 CUDA GPUs: 1 trainer + a rollout pool of 2")
    task = write_toy_task(str(tmp_path), num_heads=4, num_kv_heads=2)  # heads split over 2 TP ranks
    pools = [override for override in SEPARATE_POOLS if not override.startswith("rollout.n_gpus_per_node")]
    steps = run_toy_task(task, tmp_path / "run", *pools, "rollout.n_gpus_per_node=2",
                         "actor_rollout_ref.rollout.tensor_model_parallel_size=2", steps=STEPS)
    assert len(steps) == STEPS
    check_engine_follows_trainer(steps, "TP=2 rollout pool", shown=("timing_s/sync_weights",))
