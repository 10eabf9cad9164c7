"""One trainer run as a benchmark's subprocess, the way every benchmark here needs it on a GPU host with a 10-minute
limit per command: the output streamed into a log as it goes (a run cut off by the caller's own limit still leaves
it), an optional time limit that kills the whole process group (Ray's and the engines' processes too, so the next
run finds the GPU free), and the per-step metrics the trainer logged, read whether the run finished or not.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import time


@dataclasses.dataclass
class TrainerRun:
    code: int | str  # the exit code, or "timeout"
    wall_s: float
    log_path: str
    steps: list[dict]  # one metrics dict a step, as logged (possibly fewer than asked for)

    @property
    def error(self) -> str | None:
        """None after a clean exit, else the exit and the log's last lines."""
        if self.code == 0:
            return None
        return f"exit {self.code}: " + " | ".join(log_tail(self.log_path, 3))


def run_trainer(argv: list[str], log_path: str, metrics_path: str, timeout: float | None = None,
                env: dict | None = None, cwd: str | None = None, read_step=lambda record: record) -> TrainerRun:
    """Run `argv` with stdout and stderr streamed into `log_path`, then read `metrics_path` (JSON lines, each turned
    into a step's metrics by `read_step`). A metrics file left by an earlier run would be counted as this run's:
    it is removed first."""
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                   start_new_session=True)
        try:
            code: int | str = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = "timeout"
    wall = time.perf_counter() - started
    return TrainerRun(code, wall, log_path, read_jsonl(metrics_path, read_step))


class Deadline:
    """The whole invocation's wall-clock budget, for runs made one after another inside one GPU-host command.

    The runs share what is left of it, less `margin` (for the tables and the record after the last run): see `share`.
    Without it a later run's own limit can reach past the command's, where the host kills it with its steps unread:
    a verl start was lost that way (benchmarks/README.md)."""

    def __init__(self, seconds: float | None, margin: float = 15.0):
        self.margin = margin
        self.ends_at = None if seconds is None else time.perf_counter() + seconds

    def left(self) -> float | None:
        """Seconds a run may still take (never below 0), or None without a budget."""
        if self.ends_at is None:
            return None
        return max(0.0, self.ends_at - time.perf_counter() - self.margin)

    def share(self, runs_left: int = 1, asked: float | None = None, reserve: float = 0.0) -> float | None:
        """The time limit of the next of `runs_left` runs: an equal share of what is left after `reserve` (kept for
        work after the runs), at most `asked` (None: no limit of its own). Without a budget, just `asked`."""
        left = self.left()
        if left is None:
            return asked
        share = max(0.0, left - reserve) / runs_left
        return share if asked is None else min(asked, share)


def fresh_dir(path: str) -> str:
    """An empty run directory (the trainer appends to metrics.jsonl: an earlier run's steps would count)."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def read_jsonl(path: str, read_step=lambda record: record) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [read_step(json.loads(line)) for line in f if line.strip()]


def log_tail(path: str, lines: int) -> list[str]:
    with open(path, errors="replace") as log:
        return [line for line in log.read().strip().splitlines() if line.strip()][-lines:]


def mean_metrics(steps: list[dict]) -> dict[str, float]:
    """The mean of each numeric metric over `steps` (a metric missing from a step is averaged over the others)."""
    keys = {key for step in steps for key, value in step.items() if isinstance(value, (int, float))}
    return {key: statistics.mean(step[key] for step in steps if isinstance(step.get(key), (int, float)))
            for key in keys}
