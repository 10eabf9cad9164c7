"""Where a process's host time goes while a block runs: py-spy sampling this very process, and a summary of its
stacks.

Why: an engine loop whose CPU seconds match the wall clock is either busy in Python or spinning in a CUDA sync
(benchmarks/vllm_generation_gap.py, H200, 2026-12-02). The Python frames name the code the time goes to (the line
that waits on the GPU too); with native frames a sample in cudaStreamSynchronize / cuEventSynchronize is told apart
as a wait.

py-spy is not a dependency: scripts/gpu/stage_pyspy.sh stages its wheel, whose binary the caller names.
"""
from __future__ import annotations

import collections
import ctypes
import os
import re
import signal
import subprocess
import time

PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, -1
# Native frames of a host thread that waits on the GPU (the runtime's and the driver's entry points).
GPU_WAIT = re.compile(r"(cuda|cu)(Stream|Event|Device|Ctx)Synchronize|cuStreamQuery|cudaStreamQuery")
FRAME = re.compile(r"^(?P<name>.*?) \((?P<where>[^()]*)\)$")


def allow_tracing_by_children() -> None:
    """Let a child process (py-spy) attach to this one where the kernel's Yama module asks for that (ptrace_scope 1);
    without Yama the call fails, harmlessly, and nothing needs allowing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class PySpy:
    """`with PySpy(binary, path):` samples this process (or the process `pid`: an engine's scheduler, say), all its
    threads, native frames too, into `path` in py-spy's raw format (one "frame;frame;...;leaf count" line per distinct stack) while the block runs. By default py-spy
    reads the Python stacks without pausing the process (--nonblocking: a paused loop would run slower than the
    batches it is compared with; a rare torn stack is the price). native=True adds the C/CUDA frames, for which
    py-spy must pause the process at every sample (on CPU, 2026-12-02: a busy loop lost 15 % of its time)."""

    def __init__(self, binary: str, path: str, rate: int = 100, native: bool = False, pid: int | None = None):
        self.command = [binary, "record", "--pid", str(pid or os.getpid()), "--format", "raw", "--rate", str(rate),
                        "--output", path, *(["--native"] if native else ["--nonblocking"])]
        self.path = path

    def __enter__(self):
        """Start sampling. A py-spy that cannot attach (a host that forbids ptrace) leaves `error` set and the block
        runs unprofiled: the caller reports it, and the timing it measures around the block stays valid."""
        allow_tracing_by_children()
        self.error: str | None = None
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(1.0)  # attaching takes a moment
        if self.process.poll() is not None:
            self.error = f"py-spy exited at once ({self.process.returncode}): {self.process.stdout.read().strip()}"
        return self

    def __exit__(self, *exc):
        if self.error:
            return
        self.process.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        output, _ = self.process.communicate(timeout=60)
        if not os.path.exists(self.path):
            self.error = f"py-spy wrote no profile to {self.path}: {output.strip()}"

    def summary(self) -> dict:
        """summarize() of what was sampled, or {"error": why nothing was}."""
        return {"error": self.error} if self.error else summarize(self.path)


def read_stacks(path: str) -> list[tuple[list[str], int]]:
    """py-spy's raw file: each stack's frames (root first) and its sample count."""
    stacks = []
    with open(path) as handle:
        for line in handle:
            line = line.rstrip("\n")
            if line:
                frames, count = line.rsplit(" ", 1)
                stacks.append((frames.split(";"), int(count)))
    return stacks


def function_name(frame: str) -> str:
    """'name (file.py:12)' -> 'name (file.py)': the lines of one function count together; a native frame without a
    symbol ('0x7f12... (libc.so.6)') counts as its library's."""
    match = FRAME.match(frame)
    if match is None:
        return frame
    name = "?" if match["name"].startswith("0x") else match["name"]
    return f"{name} ({match['where'].split(':')[0]})"


def is_python(name: str) -> bool:
    return name.endswith(".py)")


def summarize(path: str, top: int = 12) -> dict:
    """The samples of a raw profile: how many, the share waiting on the GPU (a GPU_WAIT frame anywhere in the stack;
    None without native frames, which alone show the wait),
    and the `top` functions by share of samples in three views, the "process"/"thread" root frames left out:
    top_leaf (the innermost frame: where the time is spent, native or Python), top_python (the innermost Python
    frame: which Python code spends it, itself or through what it calls) and top_inclusive (every function on the
    stack: what the time is spent under)."""
    stacks = read_stacks(path)
    total = sum(count for _, count in stacks)
    views = {"top_leaf": collections.Counter(), "top_python": collections.Counter(),
             "top_inclusive": collections.Counter()}
    waiting, native = 0, False
    for frames, count in stacks:
        names = [function_name(frame) for frame in frames if not frame.startswith(("process ", "thread "))]
        if not names:
            continue
        if any(GPU_WAIT.search(name) for name in names):
            waiting += count
        native = native or not all(is_python(name) for name in names)
        views["top_leaf"][names[-1]] += count
        python = [name for name in names if is_python(name)]
        if python:
            views["top_python"][python[-1]] += count
        for name in set(names):
            views["top_inclusive"][name] += count
    share = (lambda count: count / total) if total else (lambda count: 0.0)
    return {"samples": total, "gpu_wait_share": share(waiting) if native else None,
            **{view: [(name, share(count)) for name, count in counter.most_common(top)]
               for view, counter in views.items()}}


def print_summary(title: str, summary: dict) -> None:
    if "error" in summary:
        print(f"{title}: not profiled: {summary['error']}", flush=True)
        return
    wait = summary["gpu_wait_share"]
    waiting = "no native frames" if wait is None else f"{wait:.1%} waiting on the GPU"
    print(f"{title}: {summary['samples']} samples, {waiting}", flush=True)
    for heading, key in (("  innermost frame", "top_leaf"), ("  innermost Python frame", "top_python"),
                         ("  on the stack", "top_inclusive")):
        print(heading)
        for name, share in summary[key]:
            print(f"    {share:6.1%}  {name}")
