"""Shared fixtures: a real local Ray per test module and small real models; how modules share the xdist workers."""
import faulthandler
import functools
import json
import os
import sys
import threading
import time
import traceback
import warnings

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process (torch's default is one per core): the suite runs a process per core on xdist
# workers, and each of them starts ranks, Ray workers and servers of its own; more threads than cores only make them
# wait on each other (3 gloo ranks on 2 cores: 28.6 s with a thread per core, 22.6 s with one). Ray does the same
# for its workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import hybridrl.checks  # noqa: E402,F401  any test may validate a config: register the subsystems' checks

# The default tier's tests each fail within pyproject's timeout (300 s), with their stack; a slow-tier run (several
# seeds of a learning curve) gets this much instead, unless it names its own with @pytest.mark.timeout.
SLOW_TEST_TIMEOUT_S = 1800


# Modules that must share one xdist worker, one after the other (pyproject runs the tests on `-n auto` workers):
# - the sandbox's: each asserts that nothing of a call is left on the host (sandbox processes, cgroups, files in the
#   host's temp folders), which a sandbox call of the other module on another worker would contradict;
# - the GPU tests: each takes the machine's GPUs.
HOST_STATE_MODULES = {"test_sandbox.py", "test_sandbox_attacks.py"}


def worker_group(nodeid: str) -> str:
    """The unit of work xdist gives one worker: a module, so its module-scoped Ray and models are built once, or one
    of the shared groups above."""
    path = nodeid.split("::")[0]
    if os.path.basename(path) in HOST_STATE_MODULES:
        return "host-state"
    if os.path.basename(os.path.dirname(path)) == "gpu":
        return "gpu"
    return path


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own; a run without xdist has no such hook
def pytest_xdist_make_scheduler(config, log):
    """xdist's module-at-a-time scheduling, with the groups of `worker_group` (xdist's own `xdist_group` marks are
    lost under pytest 9.2, which no longer reads the node id xdist rewrites)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # hand out modules in collection order (module_order), not by test count

    class ModuleGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ModuleGroupScheduling(config, log)


# The longest modules that do not use the module Ray (seconds alone on 2 cores, 2026-11-28), handed out first so that
# the run does not end on one of them while the other workers idle. Only the order depends on this list.
LONG_MODULES_WITHOUT_RAY = {
    "test_sandbox.py", "test_sandbox_attacks.py",  # 80 together, mostly waiting on wall-clock limits
    "test_tensor_parallel_rollout.py",  # 67
    "test_suite_isolation.py",  # 48
    "test_main_ppo.py",  # 47
    "test_sft_trainer.py",  # 41
    "test_loss_dp_invariance.py",  # 33
    "test_default_assets.py",  # 32
    "test_single_controller_cluster.py",  # 31
}


def module_order(item, ray_modules) -> int:
    """xdist hands out modules in collection order: the long ones without Ray, then those that use the module Ray
    back to back (a worker then runs them on one Ray, ray_local), then the short ones, which even out the end."""
    if item.path.name in LONG_MODULES_WITHOUT_RAY:
        return 0
    return 1 if item.path in ray_modules else 2


def pytest_collection_modifyitems(items):
    ray_modules = {item.path for item in items if "ray_local" in item.fixturenames}
    items.sort(key=lambda item: module_order(item, ray_modules))  # stable: a module's own order stays
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


# The learning tests (slow tier) assert a margin on one run's learning curve. Their margins were measured by running
# them over seeds: `pytest -m slow tests --learning-seeds 1-8 --learning-log margins.jsonl` runs each once per seed
# and writes the numbers it asserts on, one JSON line a run, whether or not the run passes. Without the option a test
# runs at the config's own seed (trainer.seed, data.seed), with no override: the run the test always made; or at the
# seeds of its @pytest.mark.learning_seeds(1, 2, 3), a test whose claim is about every seed.
@functools.cache
def config_seed() -> int:
    """The seed the composed default config trains with; trainer.seed and data.seed share it."""
    from hybridrl.config import compose_config

    config = compose_config()
    if config.trainer.seed != config.data.seed:
        raise pytest.UsageError(f"trainer.seed {config.trainer.seed} != data.seed {config.data.seed}: the learning "
                                "tests' seeds set both")
    return config.trainer.seed


def pytest_addoption(parser):
    group = parser.getgroup("hybridrl", "hybridrl's learning tests")
    group.addoption("--learning-seeds", default=None, metavar="SEEDS",
                    help="seeds each learning test runs with, as 1-8 or 1,3,5 (default: the config's own seed)")
    group.addoption("--learning-log", default=None, metavar="PATH",
                    help="append each learning run's measured numbers to PATH as a JSON line")


def parse_seeds(text: str) -> list[int]:
    """'1-8' -> [1, ..., 8]; '1,3,5' -> [1, 3, 5]; anything else is refused with what was expected."""
    seeds = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise pytest.UsageError(f"--learning-seeds {text!r}: expected seeds as 1-8 or 1,3,5")
        seeds.extend(range(int(first), int(last or first) + 1))
    return seeds


def pytest_generate_tests(metafunc):
    if "learning_seed" in metafunc.fixturenames:
        text = metafunc.config.getoption("learning_seeds")
        own_seeds = metafunc.definition.get_closest_marker("learning_seeds")
        seeds = parse_seeds(text) if text else list(own_seeds.args) if own_seeds else [config_seed()]
        metafunc.parametrize("learning_seed", seeds, ids=[f"seed{seed}" for seed in seeds])


@pytest.fixture
def seed_overrides(learning_seed) -> list[str]:
    """The overrides that make a run use this seed for training and data order; none at the default seed."""
    if learning_seed == config_seed():
        return []
    return [f"trainer.seed={learning_seed}", f"data.seed={learning_seed}"]


@pytest.fixture
def learning_log(request, learning_seed):
    """`learning_log(first=..., last=...)`: prints the numbers a learning test asserts on and appends them to
    --learning-log's file. Tests call it before asserting, so a seed that fails is measured too."""
    def log(**numbers):
        line = json.dumps({"test": request.node.originalname, "seed": learning_seed, **numbers})
        print("learning:", line)
        path = request.config.getoption("learning_log")
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
    return log


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory) -> str:
    """One HYBRIDRL_CACHE_DIR for the test session's runs of the built-in tasks (per xdist worker): the first run
    builds the data, the tiny model and the SFT warm start, every later run and seed reuses them. A cache named in
    the environment is used instead."""
    return os.environ.get("HYBRIDRL_CACHE_DIR") or str(tmp_path_factory.mktemp("builtin_cache"))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without xdist installed has none
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject): up to 4 workers, never more than the machine's CPUs. Each worker runs its own Ray with
    4 logical CPUs and up to 2 ranks, so more workers than that oversubscribe even a large machine."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.fixture
def in_process_rank(monkeypatch):
    """World size 1 in this process, as a worker group would set it up for one rank (workers built in the test)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray for the test module, with 4 logical CPUs: on the 2-core CI machine room for a driver-side
    actor plus 2 ranks.

    Modules that one worker runs back to back share it (a start costs about 8 CPU-seconds, which 20 modules paid on
    a 2-core machine), but only a Ray that the earlier module left idle: every CPU free and no named actor left. A
    module that leaves work behind, or a Ray that does not answer (`ray_that_answers`), gets a new one, so what one
    module did cannot stall the next (CI, 2026-11-27: after a stall the suite ran out of its 90 minutes). Ray stops
    before a module that does not use it (`pytest_runtest_teardown`): that module may fork, which a live Ray does
    not survive (`no_fork_while_ray_runs`). Modules that use Ray are handed out back to back (`module_order`)."""
    import ray

    if ray.is_initialized() and not _left_idle():
        ray.shutdown()
    if not ray.is_initialized():
        _start_ray()
    yield ray


# How long a module's Ray may take to free what the module held (its actors end asynchronously once their handles are
# gone) before the next module gets a new Ray instead.
RAY_IDLE_WAIT_S = 20.0
_own_ray = {"address": None}  # the Ray this file started: a Ray a test started itself is never handed on


def _left_idle() -> bool:
    import ray

    if ray.get_runtime_context().gcs_address != _own_ray["address"]:
        return False
    deadline = time.monotonic() + RAY_IDLE_WAIT_S
    while time.monotonic() < deadline:
        try:
            cpus_held = ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)
            named = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]
            if not cpus_held and not named:
                return True
        except Exception:  # a Ray that died: start a new one
            return False
        time.sleep(0.2)
    # A warning, so that the run's summary names the module that left its Ray busy (this wait and a new Ray cost it
    # about 30 s)
    warnings.warn(f"conftest: the previous module's Ray still held {cpus_held} CPUs and named actors {named} after "
                  f"{RAY_IDLE_WAIT_S} s; starting a new one", pytest.PytestWarning)
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the module's fixtures are gone: stop Ray unless the next test is in the same module or uses it."""
    yield
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    if nextitem is None or (nextitem.module is not item.module and "ray_local" not in nextitem.fixturenames):
        ray.shutdown()


# How long the module's Ray may take to run a trivial task before it is restarted (ray_that_answers).
RAY_PROBE_TIMEOUT_S = 60.0


def _start_ray():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    _own_ray["address"] = ray.get_runtime_context().gcs_address


@pytest.fixture(autouse=True)
def ray_that_answers(request):
    """Around each test that uses the module's Ray.

    Before: Ray must run a task within RAY_PROBE_TIMEOUT_S, or it is started again; a test that left Ray dead or
    stalled then costs the tests after it at most this wait. What module fixtures hold on the old Ray is gone with it,
    so their tests fail at once, naming Ray. The probe takes no CPU: module fixtures may hold all four.

    During: a test blocked in `ray.get` does not see pytest-timeout's signal (Ray's wait does not return to Python),
    so it would hang the whole run. One second after the test's timeout a watchdog prints every thread's stack and
    shuts Ray down, which makes the blocked `ray.get` raise: the test fails alone, with its stack, and the next test
    gets a new Ray."""
    if "ray_local" not in request.fixturenames:
        yield
        return
    import ray

    if not _ray_answers():
        ray.shutdown()
        _start_ray()
    watchdog = threading.Timer(_timeout_s(request) + 1, _cut_ray_loose, args=(request.node.nodeid,))
    watchdog.daemon = True
    watchdog.start()
    yield
    watchdog.cancel()


def _ray_answers() -> bool:
    import ray

    if not ray.is_initialized():
        print("conftest: the module's Ray was shut down; starting it again", file=sys.stderr)
        return False
    try:
        ray.get(ray.remote(num_cpus=0)(lambda: "answered").remote(), timeout=RAY_PROBE_TIMEOUT_S)
        return True
    except Exception as error:  # GetTimeoutError, or a Ray that died
        print(f"conftest: the module's Ray did not run a task within {RAY_PROBE_TIMEOUT_S} s ({error!r}); "
              "starting it again", file=sys.stderr)
        return False


def _timeout_s(request) -> float:
    marker = request.node.get_closest_marker("timeout")
    if marker is not None:
        return float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    return float(request.config.getini("timeout"))


def _cut_ray_loose(nodeid: str) -> None:
    import ray

    print(f"\nconftest: {nodeid} passed its timeout waiting on Ray; every thread's stack, then Ray is shut down:",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
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


@pytest.fixture(scope="session")
def toy_task(tmp_path_factory):
    """The toy task (tests/toy_task.py), built once for the whole session; tests only read it."""
    from toy_task import build_toy_task

    return build_toy_task(tmp_path_factory.mktemp("toy"))


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
