"""Shared fixtures: a real local Ray and small real models, built once per test session."""
import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_local():
    """A real local Ray. 4 logical CPUs on the 2-core CI machine leave room for a driver-side actor plus 2 ranks."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def engine_rollout_config():
    """A validated rollout section with non-default sampling and engine keys: what the sglang and vllm rollouts'
    mapping tests translate into engine arguments."""
    from hybridrl.config import compose_config, validate_config

    config = validate_config(compose_config([
        "data.max_prompt_length=100", "data.max_response_length=28", "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.top_p=0.9", "actor_rollout_ref.rollout.top_k=50",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.max_num_seqs=256",
        "actor_rollout_ref.rollout.enforce_eager=true"]))
    return config.actor_rollout_ref.rollout
