"""What the engine-parametrized GPU tests share: each engine's own config keys (an engine's name is also the package
its param imports, and skips without), and the policy worker the worker-level tests drive.

Imported by test_engine_hybrid.py, test_engine_worker.py and test_engine_async_server.py (pytest puts this folder on
sys.path for them).
"""
from __future__ import annotations

import os

import pytest

from benchmarks.hybrid_engine import hybrid_config, init_single_gpu_process_group, make_qwen05b_model

PROMPT_LENGTH, RESPONSE_LENGTH = 64, 64
ENGINE_OVERRIDES = {
    # prefill CUDA graphs only lengthen SGLang's start here; decode graphs stay on
    "sglang": ["+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_prefill_cuda_graph=true"],
    "vllm": ["actor_rollout_ref.rollout.gpu_memory_utilization=0.4"],
}


def importable_engine(request) -> str:
    """The body of an `engine` fixture parametrized over ENGINE_OVERRIDES: skips the param whose package is missing."""
    pytest.importorskip(request.param)
    return request.param


def policy_worker(engine: str, tmp_path_factory, overrides: list[str], role: str = "actor_rollout"):
    """An initialised ActorRolloutRefWorker on the GPU with rollout.name=`engine`: the random Qwen2.5-0.5B-shaped model
    ($HYBRIDRL_GPU_MODEL_DIR when set, so the test processes of one run make it once), PROMPT_LENGTH + RESPONSE_LENGTH
    tokens, one response per prompt, mini- and micro-batches of 8, the engine's own keys, then `overrides`."""
    from hybridrl.models.spec import policy_model_spec
    from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker

    model_dir = make_qwen05b_model(os.environ.get("HYBRIDRL_GPU_MODEL_DIR") or str(tmp_path_factory.mktemp("q05")))
    init_single_gpu_process_group()
    config = hybrid_config(model_dir, [
        f"data.max_prompt_length={PROMPT_LENGTH}", f"data.max_response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", *ENGINE_OVERRIDES[engine], *overrides], engine=engine)
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, policy_model_spec(config), role=role, seed=1,
                                   device="cuda")
    worker.init_model()
    return worker
