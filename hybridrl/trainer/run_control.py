"""Stopping a run on SIGTERM or SIGINT: the driver catches the signal, the trainer stops at a step boundary.

The driver (main_ppo) counts the signals instead of dying on them (`StopSignals`). With
``trainer.stop_on_signal=after_step`` the first one asks the trainer, through the `RunControl` actor, to stop once
the running step is done; the trainer then saves a checkpoint of that step (when ``trainer.save_freq > 0``) and
returns. A second signal, or ``stop_on_signal=now``, stops at once: the TaskRunner is killed, and the last checkpoint
is the last one it published. Either way the driver shuts Ray down, prints `stop_report` (``stopped at step N; last
checkpoint <dir>; rerun to resume``) and exits with 128 + the signal's number, as a shell reports a process killed
by it: 143 for SIGTERM, 130 for SIGINT.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

import ray

from hybridrl.trainer.checkpoint_dir import find_latest_checkpoint

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@ray.remote(num_cpus=0)
class RunControl:
    """What the driver and the trainer tell each other while the trainer runs: a stop request, the last step done."""

    def __init__(self):
        self._stop_requested = False
        self._last_step: Optional[int] = None

    def request_stop(self) -> None:
        self._stop_requested = True

    def stop_requested(self) -> bool:
        return self._stop_requested

    def record_step(self, step: int) -> None:
        self._last_step = step

    def last_step(self) -> Optional[int]:
        return self._last_step


class StopSignals:
    """While installed, SIGTERM and SIGINT are recorded in `received` (in order) instead of ending the process."""

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        """(Re)install the handlers; call it again after ray.init, which sets its own SIGTERM handler."""
        for signum in STOP_SIGNALS:
            previous = signal.signal(signum, self._record)
            self._previous.setdefault(signum, previous)

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _record(self, signum: int, frame) -> None:
        self.received.append(signum)

    @property
    def first(self) -> Optional[int]:
        return self.received[0] if self.received else None


def wait_or_stop(runner, result: ray.ObjectRef, control, signals: StopSignals, trainer_config) -> dict:
    """The TaskRunner's summary (``result`` of ``runner``'s run), plus ``stopped_by_signal`` (None, or the first
    signal's number) and ``stop_report``; on a signal, first ask the trainer to stop after its step, or stop at once
    (module docstring)."""
    asked_to_stop = False
    while True:
        received = list(signals.received)  # one snapshot per round: a signal may land at any line
        if _must_stop_now(received, trainer_config.stop_on_signal):
            break
        if ray.wait([result], timeout=0.25)[0]:
            summary = ray.get(result)
            report = stop_report(summary["steps"], trainer_config) if summary["stopped_early"] else None
            return {**summary, "stopped_by_signal": signals.first if report else None, "stop_report": report}
        if received and not asked_to_stop:
            control.request_stop.remote()
            asked_to_stop = True
            print(f"received {signal.Signals(received[0]).name}: stopping after the current step "
                  f"(trainer.stop_on_signal=after_step); send it again to stop at once", flush=True)
    print(f"received {signal.Signals(received[-1]).name}: stopping now", flush=True)
    try:
        step = ray.get(control.last_step.remote(), timeout=5)
    except ray.exceptions.GetTimeoutError:
        step = None
    _kill_and_wait(runner, result)
    return {"stopped_by_signal": signals.first, "stop_report": stop_report(step, trainer_config)}


def _kill_and_wait(runner, result: ray.ObjectRef, timeout: float = 30) -> None:
    """Kill the TaskRunner and wait until Ray reports it dead: it publishes checkpoints (the rename of a finished
    save), so the stop report may name the newest one only once nothing can publish another."""
    ray.kill(runner, no_restart=True)
    ray.wait([result], timeout=timeout)


def _must_stop_now(received: list[int], stop_on_signal: str) -> bool:
    return len(received) >= 2 or (len(received) == 1 and stop_on_signal == "now")


def stop_report(step: Optional[int], trainer_config) -> str:
    """The line the driver prints after a stop: the step, the checkpoint a rerun resumes from, how to rerun."""
    checkpoint = find_latest_checkpoint(os.path.abspath(trainer_config.default_local_dir))
    stopped = "stopped before the first step" if step is None else f"stopped at step {step}"
    if checkpoint is None:
        return (f"{stopped}; last checkpoint none (trainer.save_freq={trainer_config.save_freq}); a rerun starts from "
                f"the beginning")
    if trainer_config.resume_mode != "auto":
        return f"{stopped}; last checkpoint {checkpoint}; rerun with trainer.resume_mode=auto to resume"
    return f"{stopped}; last checkpoint {checkpoint}; rerun to resume"
