"""Worker-group calls that hang are reported and fail (heartbeat.py): real local Ray, 2 ranks, real signals.

Before, a rank stopped with SIGSTOP hung the run with no output at all, and trainer.ray_wait_register_center_timeout
was accepted and never read. Each case here uses short timeouts, so it fails in seconds.
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

WATCH = WorkerWatch(start_timeout=60, heartbeat_interval=0.5, heartbeat_timeout=3.0, call_timeout=60)


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
    def rank_1_raises_rank_0_sleeps(self) -> int:
        if self.rank == 1:
            raise ZeroDivisionError("rank 1 cannot go on")
        time.sleep(60)
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
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="hybridrl.single_controller.heartbeat"), \
            pytest.raises(WorkerTimeoutError) as caught:
        group.all_reduce_ones()  # rank 0 waits in the collective for rank 1, which cannot run
    took = time.monotonic() - start
    assert WATCH.heartbeat_timeout <= took < WATCH.heartbeat_timeout + 3 * WATCH.heartbeat_interval
    message = str(caught.value)
    assert re.match(r"all_reduce_ones: waited [345] s for rank\(s\) \[0, 1\]; rank\(s\) \[1\] sent no heartbeat "
                    r"for trainer.heartbeat_timeout=3 s", message)
    assert re.search(rf"rank 1 \(sleepy_1, pid {pids[1]} on [\d.]+: last heartbeat [34]\.\d s ago\)", message)
    assert re.search(rf"rank 0 \(sleepy_0, pid {pids[0]} on [\d.]+: last heartbeat 0\.\d s ago\)", message)  # alive
    # while waiting, the silent rank was logged before the run failed
    logged = [record.getMessage() for record in caplog.records]
    assert any(re.search(rf"rank 1 \(sleepy_1, pid {pids[1]} on [\d.]+: last heartbeat [12]\.\d s ago\)", line)
               for line in logged)
    assert logged and all(line.endswith("(the run fails at trainer.heartbeat_timeout=3 s)") for line in logged)


def test_a_call_past_the_call_timeout_fails_with_every_rank_state(pool):
    watch = WorkerWatch(start_timeout=60, heartbeat_interval=0.5, heartbeat_timeout=30, call_timeout=1.5)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(SleepyWorker), name_prefix="slow", watch=watch)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as caught:
        group.sleep_on_rank_1(60)
    assert 1.5 <= time.monotonic() - start < 3.0
    assert re.fullmatch(r"sleep_on_rank_1: waited [23] s for rank\(s\) \[1\], longer than "
                        r"trainer.worker_call_timeout=1.5 s: rank 1 \(slow_1, pid \d+ on [\d.]+: last heartbeat "
                        r"0.\d s ago\)", str(caught.value))


def test_a_rank_that_raises_fails_the_call_at_once_while_another_still_runs(pool):
    group = RayWorkerGroup(pool, RayClassWithInitArgs(SleepyWorker), watch=WATCH)
    start = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="rank 1 cannot go on"):
        group.rank_1_raises_rank_0_sleeps()
    assert time.monotonic() - start < 2 * WATCH.heartbeat_interval + 1


def test_ranks_that_do_not_start_in_time_fail_naming_them(pool):
    """trainer.ray_wait_register_center_timeout is read: it bounds the workers' start (verl: the register center's)."""
    # rank 0's process starts within the 6 s (it imports torch: seconds on a loaded 2-core machine); rank 1 sleeps
    watch = WorkerWatch(start_timeout=6, heartbeat_interval=0.5, heartbeat_timeout=30, call_timeout=None)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as caught:
        RayWorkerGroup(pool, RayClassWithInitArgs(SleepyWorker, init_sleep_on_rank_1=60), name_prefix="late",
                       watch=watch)
    assert 6 <= time.monotonic() - start < 7.5
    assert re.fullmatch(r"starting SleepyWorker: waited [67] s for rank\(s\) \[1\], longer than "
                        r"trainer.ray_wait_register_center_timeout=6 s: rank 1 \(late_1, not finished\)",
                        str(caught.value))
