"""Which rank is silent, and for how long: heartbeats from the worker processes, checked while the controller waits.

A call on a worker group waits for every rank. Ray notices a rank whose process died, but not one that is stopped
(SIGSTOP), swapped out or hung: without more, the controller waits forever and prints nothing. So:

- every worker process runs a daemon thread that sends its rank, pid and node to the group's HeartbeatMonitor actor
  every ``heartbeat_interval`` seconds (``start_heartbeat``, called by Worker.__init__);
- the controller's wait on a call (``wait_for_ranks``) takes each rank's result as soon as it is there (so a rank
  that raised or died fails the call at once) and, every ``heartbeat_interval`` seconds, asks the monitor how long
  each rank it still waits for has been silent. A rank that missed two heartbeats is logged (rank, actor, pid, node,
  seconds); one silent for ``heartbeat_timeout`` seconds, or a call running past ``call_timeout``, fails the call
  with WorkerTimeoutError and that report.

The heartbeat thread stops only when the process's Python cannot run at all (stopped, or C code that holds the GIL
without end): a rank busy in torch or blocked in a collective keeps beating, so the silent rank is the culprit and the
ranks waiting for it are not.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import ray

logger = logging.getLogger(__name__)

MONITOR_ENV = "HYBRIDRL_HEARTBEAT_MONITOR"  # the monitor actor's name, set on every worker by the group
INTERVAL_ENV = "HYBRIDRL_HEARTBEAT_INTERVAL"


@dataclass(frozen=True)
class WorkerWatch:
    """How a worker group watches its ranks (seconds; the trainer fills it from the ``trainer.*`` keys named)."""

    start_timeout: float  # trainer.ray_wait_register_center_timeout: for every rank's process to be constructed
    heartbeat_interval: float  # trainer.heartbeat_interval
    heartbeat_timeout: float  # trainer.heartbeat_timeout
    call_timeout: Optional[float]  # trainer.worker_call_timeout; None: no limit

    @classmethod
    def from_trainer_config(cls, trainer) -> WorkerWatch:
        return cls(start_timeout=trainer.ray_wait_register_center_timeout,
                   heartbeat_interval=trainer.heartbeat_interval, heartbeat_timeout=trainer.heartbeat_timeout,
                   call_timeout=trainer.worker_call_timeout)


class WorkerTimeoutError(TimeoutError):
    """A worker-group call gave up on ranks that were silent too long or did not finish in time."""


@ray.remote(num_cpus=0)
class HeartbeatMonitor:
    """The last heartbeat of every rank of a group, timed on this actor's clock."""

    def __init__(self):
        self._created = time.monotonic()
        self._last: dict[int, tuple[float, int, str]] = {}  # rank -> (time, pid, node ip)

    def beat(self, rank: int, pid: int, node_ip: str) -> None:
        self._last[rank] = (time.monotonic(), pid, node_ip)

    def silence(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """Per rank: seconds since its last heartbeat (since this monitor started if it never sent one)."""
        now = time.monotonic()
        report = {}
        for rank in ranks:
            at, pid, node_ip = self._last.get(rank, (self._created, None, None))
            report[rank] = {"silent_s": now - at, "pid": pid, "node_ip": node_ip, "ever": rank in self._last}
        return report


_heartbeat_started = False


def start_heartbeat(rank: int) -> None:
    """Start this process's heartbeat thread when its group asked for one (once per process: colocated roles share
    it)."""
    global _heartbeat_started
    monitor_name = os.environ.get(MONITOR_ENV)
    if not monitor_name or _heartbeat_started:
        return
    _heartbeat_started = True
    interval = float(os.environ[INTERVAL_ENV])
    monitor = ray.get_actor(monitor_name)
    pid, node_ip = os.getpid(), ray.util.get_node_ip_address()

    def beat_forever() -> None:
        while True:
            monitor.beat.remote(rank, pid, node_ip)
            time.sleep(interval)

    threading.Thread(target=beat_forever, name="hybridrl-heartbeat", daemon=True).start()


def wait_for_ranks(refs: list[ray.ObjectRef], ranks: list[int], what: str, monitor, watch: Optional[WorkerWatch],
                   actor_names: dict[int, str], limit: Optional[float] = None, limit_key: str = "") -> list:
    """The results of ``refs`` (rank ``ranks[i]`` computes ``refs[i]``) in order, watched as the module docstring says.

    ``limit`` (seconds, named ``limit_key`` in messages) overrides the call timeout; ``monitor`` None waits without
    heartbeats (used while the ranks' processes are being constructed, before they can beat).
    """
    if watch is None:
        return ray.get(refs)
    limit, limit_key = (watch.call_timeout, "trainer.worker_call_timeout") if limit is None else (limit, limit_key)
    start = time.monotonic()
    pending = dict(zip(refs, ranks))
    results: dict[ray.ObjectRef, Any] = {}
    next_check = start + watch.heartbeat_interval
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, next_check - time.monotonic()))
        for ref in done:
            results[ref] = ray.get(ref)  # a rank that raised or died fails the call now, not after the others
            del pending[ref]
        if pending and time.monotonic() >= next_check:
            _check(sorted(pending.values()), what, monitor, watch, actor_names, time.monotonic() - start, limit,
                   limit_key)
            next_check += watch.heartbeat_interval
    return [results[ref] for ref in refs]


def _check(pending_ranks: list[int], what: str, monitor, watch: WorkerWatch, actor_names: dict[int, str],
           waited: float, limit: Optional[float], limit_key: str) -> None:
    """Log the ranks that missed heartbeats; raise when one is silent too long or the call ran out of time."""
    silence = _silence(monitor, pending_ranks, watch)
    report = "; ".join(_describe(rank, silence.get(rank), actor_names) for rank in pending_ranks)
    waiting = f"{what}: waited {waited:.0f} s for rank(s) {pending_ranks}"
    too_silent = [rank for rank, state in silence.items() if state["silent_s"] >= watch.heartbeat_timeout]
    if too_silent:
        raise WorkerTimeoutError(
            f"{waiting}; rank(s) {too_silent} sent no heartbeat for trainer.heartbeat_timeout="
            f"{watch.heartbeat_timeout:g} s (a stopped process, one hung in code that holds the GIL, or one swapped "
            f"out): {report}")
    if limit is not None and waited >= limit:
        raise WorkerTimeoutError(f"{waiting}, longer than {limit_key}={limit:g} s: {report}")
    if any(state["silent_s"] >= 2 * watch.heartbeat_interval for state in silence.values()):
        logger.warning("%s: %s (the run fails at trainer.heartbeat_timeout=%g s)", waiting, report,
                       watch.heartbeat_timeout)


def _silence(monitor, ranks: list[int], watch: WorkerWatch) -> dict[int, dict[str, Any]]:
    if monitor is None:
        return {}
    try:
        return ray.get(monitor.silence.remote(ranks), timeout=watch.heartbeat_interval)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as error:
        logger.warning("the heartbeat monitor did not answer within %g s (%s); rank silence unknown this time",
                       watch.heartbeat_interval, type(error).__name__)
        return {}


def _describe(rank: int, state: Optional[dict], actor_names: dict[int, str]) -> str:
    name = f"rank {rank} ({actor_names.get(rank, 'actor ?')}"
    if state is None:
        return name + ", not finished)"
    if not state["ever"]:
        return name + f", no heartbeat yet in {state['silent_s']:.1f} s)"
    return name + f", pid {state['pid']} on {state['node_ip']}: last heartbeat {state['silent_s']:.1f} s ago)"
