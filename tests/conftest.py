"""Shared fixtures: a real local Ray per test module and small real models."""
import os
import sys
import traceback

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray for one test module. 4 logical CPUs on the 2-core CI machine leave room for a driver-side
    actor plus 2 ranks. One per module, not one per session: a module that leaves Ray unable to answer fails alone
    instead of hanging every module after it (CI, 2026-11-27: after a stall the suite ran out of its 90 minutes)."""
    import ray

    if ray.is_initialized():  # a test without this fixture started Ray implicitly, with other settings
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


_forks_while_ray_runs: list[str] = []


def _record_fork_while_ray_runs() -> None:
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        _forks_while_ray_runs.append("".join(traceback.format_stack(limit=16)[:-1]))


os.register_at_fork(before=_record_fork_while_ray_runs)


@pytest.fixture(autouse=True)
def no_fork_while_ray_runs():
    """Fails a test that forks the test process while its Ray runs: a fork copies Ray's gRPC threads mid-call, and
    the driver can stop hearing its actors' state (see make_dataloader). Spawn the process instead."""
    yield
    if _forks_while_ray_runs:
        where = "\n---\n".join(_forks_while_ray_runs)
        _forks_while_ray_runs.clear()
        pytest.fail(f"the test process forked while its Ray ran; spawn instead. Forked at:\n{where}")


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
