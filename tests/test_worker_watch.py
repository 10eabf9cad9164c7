"""Worker-group calls that hang are reported and fail (heartbeat.py): real local Ray, 2 ranks, real signals.

Before, a rank stopped with SIGSTOP hung the run with no output at all, and trainer.ray_wait_register_center_timeout
was accepted and never read. Each case here uses short timeouts, so it fails in seconds. The seconds checked are the
watch's own reports, bounded below by the limit that fired (a loaded machine makes them longer, never shorter); what
must happen before something else is made sure of by the test, not left to a race with a sleep.
"""
import logging
import os
import re
import signal
import sys
import time

import pytest
import ray
import torch
import torch.distributed as dist

from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.single_controller.heartbeat import WorkerTimeoutError, WorkerWatch
from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridrl.utils.distributed import init_process_group_once

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

# heartbeat_timeout: 20 checks after the first warning (at 2 intervals of silence) to log the silent rank before it
# fails the call, even where a loaded machine's monitor misses some answers (each waits one interval). The start and
# call limits are hang guards that no load reaches (a rank took over 60 s to start at a 1-minute load of 18).
WATCH = WorkerWatch(start_timeout=300, heartbeat_interval=0.5, heartbeat_timeout=10.0, call_timeout=300)


def rank_state(rank: int, name: str, pid="\\d+") -> str:
    """A regex of one rank's state as a WorkerTimeoutError or warning reports it; group 1: its seconds of silence."""
    return rf"rank {rank} \({name}_{rank}, pid {pid} on [\d.]+: last heartbeat (\d+\.\d) s ago\)"


class SleepyWorker(Worker):
    def __init__(self, init_sleep_on_rank_1: float = 0.0):
        super().__init__()
        if self.rank == 1:
            time.sleep(init_sleep_on_rank_1)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_ones(self) -> float:
        init_process_group_once()
        value = torch.ones(1)
        dist.all_reduce(value)
        return value.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def sleep_on_rank_1(self, seconds: float) -> int:
        if self.rank == 1:
            time.sleep(seconds)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rank_1_raises_rank_0_waits(self, release: str) -> int:
        """Rank 0 runs until the file `release` exists (writing `release`.gave_up if that takes over 120 s)."""
        if self.rank == 1:
            raise ZeroDivisionError("rank 1 cannot go on")
        deadline = time.monotonic() + 120
        while not os.path.exists(release):
            if time.monotonic() > deadline:
                open(f"{release}.gave_up", "w").close()
                break
            time.sleep(0.05)
        return self.rank


@pytest.fixture
def pool(ray_local):
    pool = RayResourcePool([2], use_gpu=False)
    yield pool
    pool.remove()  # kills the actors, a stopped one included (SIGKILL needs no SIGCONT)


def test_a_stopped_rank_is_logged_then_fails_the_call_naming_it(pool, caplog):
    group = RayWorkerGroup(pool, RayClassWithInitArgs(SleepyWorker), name_prefix="sleepy", watch=WATCH)
    assert group.all_reduce_ones() == [2.0, 2.0]  # both ranks joined the process group
    pids = group.pid()
    os.kill(pids[1], signal.SIGSTOP)
    with caplog.at_level(logging.WARNING, logger="hybridrl.single_controller.heartbeat"), \
            pytest.raises(WorkerTimeoutError) as caught:
        group.all_reduce_ones()  # rank 0 waits in the collective for rank 1, which cannot run
    message = str(caught.value)
    assert re.match(r"all_reduce_ones: waited \d+ s for rank\(s\) \[0, 1\]; rank\(s\) \[1\] sent no heartbeat "
                    r"for trainer.heartbeat_timeout=10 s", message)
    silent = re.search(rank_state(1, "sleepy", pids[1]), message)
    assert silent and float(silent.group(1)) >= WATCH.heartbeat_timeout  # the stopped rank, silent for the timeout
    assert re.search(rank_state(0, "sleepy", pids[0]), message)  # alive: heard from within the timeout ([1] above)
    # while waiting, the silent rank was logged before the run failed (under the timeout, or it would have failed)
    logged = [record.getMessage() for record in caplog.records]
    reports = [line for line in logged if line.endswith("(the run fails at trainer.heartbeat_timeout=10 s)")]
    assert any(re.search(rank_state(1, "sleepy", pids[1]), line) for line in reports), logged
    # nothing else was logged but, on a loaded machine, that the monitor once answered late
    assert all(line in reports or "heartbeat monitor did not answer within" in line for line in logged), logged


def test_a_call_past_the_call_timeout_fails_with_every_rank_state(pool):
    """Rank 1 sleeps 60 s. Rank 0 answers at once; on a loaded machine its answer may still be on its way at the
    timeout, and it is then named too, with its state, as every rank still waited for is."""
    watch = WorkerWatch(start_timeout=300, heartbeat_interval=0.5, heartbeat_timeout=30, call_timeout=1.5)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(SleepyWorker), name_prefix="slow", watch=watch)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as caught:
        group.sleep_on_rank_1(60)
    assert time.monotonic() - start >= 1.5
    report = re.fullmatch(rf"sleep_on_rank_1: waited (\d+) s for rank\(s\) \[(?:0, )?1\], longer than "
                          rf"trainer.worker_call_timeout=1.5 s: (?:{rank_state(0, 'slow')}; )?{rank_state(1, 'slow')}",
                          str(caught.value))
    assert report and int(report.group(1)) >= 2, str(caught.value)  # 1.5 s or more, printed rounded


def test_a_rank_that_raises_fails_the_call_at_once_while_another_still_runs(pool, tmp_path):
    """Rank 0 runs until the test releases it, after the call has failed: so the failure did not wait for rank 0,
    shown without timing anything (rank 0 gives up only after 120 s, and says so)."""
    release = tmp_path / "release"
    group = RayWorkerGroup(pool, RayClassWithInitArgs(SleepyWorker), name_prefix="raising", watch=WATCH)
    try:
        with pytest.raises(ZeroDivisionError, match="rank 1 cannot go on"):
            group.rank_1_raises_rank_0_waits(str(release))
    finally:
        release.touch()
    assert not os.path.exists(f"{release}.gave_up"), "the call waited for rank 0"
    # Freeing the pool ends the group's heartbeat monitor with its ranks, while the driver still holds the group
    # (it used to live on until the group object was collected, and so held the next test module's Ray).
    assert group_actors("raising") == ["raising_0", "raising_1", "raising_heartbeat"]
    pool.remove()
    deadline = time.monotonic() + 60  # a bound for a loaded machine: Ray kills the actors asynchronously
    while group_actors("raising") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_actors("raising") == [] and group is not None


def group_actors(name_prefix: str) -> list[str]:
    """The named actors of the group `name_prefix` (an earlier test's group may still be dying)."""
    names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(name for name in names if name.startswith(f"{name_prefix}_"))


def test_ranks_that_do_not_start_in_time_fail_naming_them(pool):
    """trainer.ray_wait_register_center_timeout is read: it bounds the workers' start (verl: the register center's).
    Rank 1 sleeps 60 s in its constructor. Rank 0's process starts within the 6 s as a rule (it imports torch:
    seconds on a loaded 2-core machine); when it has not, it is named too, as every rank not started is."""
    watch = WorkerWatch(start_timeout=6, heartbeat_interval=0.5, heartbeat_timeout=30, call_timeout=None)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as caught:
        RayWorkerGroup(pool, RayClassWithInitArgs(SleepyWorker, init_sleep_on_rank_1=60), name_prefix="late",
                       watch=watch)
    assert time.monotonic() - start >= 6
    report = re.fullmatch(r"starting SleepyWorker: waited (\d+) s for rank\(s\) \[(?:0, )?1\], longer than "
                          r"trainer.ray_wait_register_center_timeout=6 s: (?:rank 0 \(late_0, not finished\); )?"
                          r"rank 1 \(late_1, not finished\)", str(caught.value))
    assert report and int(report.group(1)) >= 6, str(caught.value)
