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
