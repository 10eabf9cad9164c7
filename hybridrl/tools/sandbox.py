"""Host side of the code sandbox: run one Python snippet in a fresh, isolated, limited process.

Each call gets a private temporary directory (mode 0700, removed afterwards) holding the code and
the launcher's spec; `python -I sandbox_launcher.py spec.json` starts in its own session (process
group) with a minimal environment and stdin from /dev/null. The launcher (see its docstring) enters
new user/network/mount/PID namespaces, makes the filesystem read-only except its cwd and a private
/tmp, sets the rlimits of `SandboxLimits`, drops every capability, forbids new processes with
seccomp, and runs the code as pid 1 of its PID namespace.

The host enforces the wall clock: past `timeout_s` it SIGKILLs the launcher's process group; the
launcher's child dies with it (PR_SET_PDEATHSIG), and so does everything in its PID namespace.
The same kill runs when the awaiting task is cancelled (e.g. by `run_tool_call`'s timeout), so a
cancelled call leaves no process behind.

Not covered: the code can read whatever the host user can read (it has no network to send it
anywhere, but it can print it into the conversation); it needs Linux >= 5.12 (mount_setattr) with
unprivileged user namespaces, x86_64 or aarch64, else the tool refuses to start (see
probe_isolation). With `allow_network: true` on such a machine the code runs with the rlimits, the
seccomp filter and (as root) no capabilities only: network, host filesystem and processes open.

stdout and stderr share one pipe (interleaved as written: the code runs unbuffered). The host keeps
at most `max_output_bytes` from the head and as many from the tail and drains the rest, so a
process printing gigabytes costs neither host memory nor a blocked pipe.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger(__name__)

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
SETUP_FAILED = 125  # the launcher's exit code when it could not build the sandbox
MINIMAL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits; the code interpreter tool reads them from its YAML `config:` block."""
    timeout_s: float = 10.0                 # wall clock, host-enforced: SIGKILL of the whole process group
    cpu_time_s: int = 5                     # RLIMIT_CPU: SIGKILL at this many CPU seconds (exit 128+SIGXCPU)
    memory_mb: int = 1024                   # RLIMIT_AS: allocations beyond fail (MemoryError in Python)
    file_size_mb: int = 16                  # RLIMIT_FSIZE: a larger write fails (EFBIG); also /tmp's tmpfs size
    open_files: int = 64                    # RLIMIT_NOFILE
    processes: int = 32                     # RLIMIT_NPROC (threads count); new processes are refused anyway
    max_output_bytes: int = 1 << 20         # bytes kept from each end of the output

    def launcher_limits(self) -> dict:
        mib = 1 << 20
        return {"cpu_time_s": max(1, math.ceil(self.cpu_time_s)), "memory_bytes": int(self.memory_mb * mib),
                "file_size_bytes": int(self.file_size_mb * mib), "tmpfs_bytes": int(self.file_size_mb * mib),
                "open_files": int(self.open_files), "processes": int(self.processes)}


@dataclass
class SandboxResult:
    """What one call did. exit_code: the code's exit status, or 128 + signal when a signal ended it."""
    output: str
    exit_code: int | None
    timed_out: bool
    wall_s: float
    output_bytes: int

    @property
    def signal_name(self) -> str | None:
        if self.exit_code is None or self.exit_code <= 128 or self.exit_code == SETUP_FAILED:
            return None
        try:
            return signal.Signals(self.exit_code - 128).name
        except ValueError:
            return None


class SandboxUnavailable(RuntimeError):
    """The kernel refused the isolation the config asks for (namespaces, mounts or seccomp)."""


class _BoundedOutput:
    """Keeps the first and last `limit` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.head, self.tail, self.total = limit, bytearray(), bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail = (self.tail + chunk)[-self.limit:]

    def text(self) -> str:
        dropped = self.total - len(self.head) - len(self.tail)
        middle = f"\n...({dropped} bytes dropped)...\n".encode() if dropped > 0 else b""
        return (bytes(self.head) + middle + bytes(self.tail)).decode("utf-8", errors="replace")


def _write_spec(workdir: str, code: str, limits: SandboxLimits, namespaces: bool, allow_network: bool) -> str:
    with open(os.path.join(workdir, "main.py"), "w") as f:
        f.write(code)
    spec = {"python": sys.executable, "script": "main.py", "env": {**MINIMAL_ENV, "HOME": workdir, "TMPDIR": workdir},
            "namespaces": namespaces, "allow_network": allow_network, "limits": limits.launcher_limits()}
    spec_path = os.path.join(workdir, ".sandbox_spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    return spec_path


def _kill_group(process) -> None:
    """SIGKILL the launcher's process group (start_new_session: its pid is the group id). Only while the
    launcher is unreaped: once reaped, its pid, and so that group id, may already belong to someone else."""
    if process.returncode is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _remove(workdir: str) -> None:
    """rmtree that also removes what the code made unreadable (chmod 0 directories)."""
    def make_writable_and_retry(function, path, _):
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path):
            os.chmod(path, 0o700)
        function(path)
    shutil.rmtree(workdir, onerror=make_writable_and_retry)


async def run_python(code: str, limits: SandboxLimits, namespaces: bool = True,
                     allow_network: bool = False) -> SandboxResult:
    """Run `code` once in the sandbox; never raises for anything the code does."""
    workdir = tempfile.mkdtemp(prefix="hybridrl-sandbox-")
    started = time.monotonic()
    try:
        spec_path = _write_spec(workdir, code, limits, namespaces, allow_network)
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", LAUNCHER, spec_path, cwd=workdir, env=dict(MINIMAL_ENV),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        output = _BoundedOutput(limits.max_output_bytes)
        timed_out = False
        try:
            await asyncio.wait_for(_drain(process, output), timeout=limits.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # also on cancellation: nothing of this call outlives it, and the pipe is closed
            _kill_group(process)
            await _reap(process)
        exit_code = None if timed_out else process.returncode
        return SandboxResult(output=output.text(), exit_code=exit_code, timed_out=timed_out,
                             wall_s=time.monotonic() - started, output_bytes=output.total)
    finally:
        _remove(workdir)


async def _reap(process) -> None:
    """Read the killed process's pipe to EOF and wait for it, so its transport closes on this loop."""
    try:
        await asyncio.wait_for(process.communicate(), timeout=5)
    except (asyncio.TimeoutError, OSError, ValueError):
        logger.warning("sandbox process %d not reaped within 5 s of SIGKILL", process.pid)


async def _drain(process, output: _BoundedOutput) -> None:
    while chunk := await process.stdout.read(1 << 16):
        output.add(chunk)
    await process.wait()


def _run_sync(code: str, namespaces: bool, allow_network: bool) -> tuple[int, str]:
    """One blocking sandbox run with default limits (callable inside or outside an event loop)."""
    workdir = tempfile.mkdtemp(prefix="hybridrl-sandbox-probe-")
    try:
        spec_path = _write_spec(workdir, code, SandboxLimits(), namespaces, allow_network)
        result = subprocess.run([sys.executable, "-I", LAUNCHER, spec_path], cwd=workdir, env=dict(MINIMAL_ENV),
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        return result.returncode, (result.stdout + result.stderr).strip()
    finally:
        _remove(workdir)


# The way out both refusals offer where the sandbox cannot be built.
_WITHOUT_NAMESPACES = ("set allow_network: true in the tool's config to run code without namespaces (rlimits and the "
                       "no-new-process filter only: network and host filesystem open)")


def probe_isolation(allow_network: bool) -> bool:
    """Whether the namespaced sandbox works here: run a snippet in it once, at tool creation.

    True: the full sandbox ran (and, unless allow_network, a socket could not reach the network).
    Without namespaces: raises SandboxUnavailable, unless allow_network, where it checks that the
    plain launcher (rlimits + no-new-process filter) works, logs a warning and returns False.
    """
    if not allow_network:
        _check_python_is_visible_inside()
    check_network = "import socket\ntry:\n    socket.create_connection(('192.0.2.1', 9), timeout=1)\n" \
                    "except OSError:\n    pass\nelse:\n    raise SystemExit('network reachable')\n"
    exit_code, output = _run_sync("pass" if allow_network else check_network, True, allow_network)
    if exit_code == 0:
        return True
    reason = output or f"exit code {exit_code}"
    if not allow_network:
        raise SandboxUnavailable(
            f"cannot build the code sandbox (user + network + mount + PID namespaces): {reason}. Allow "
            "unprivileged user namespaces (sysctls user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1,"
            " kernel.apparmor_restrict_unprivileged_userns=0; in Docker a seccomp profile allowing unshare/mount), "
            f"or {_WITHOUT_NAMESPACES}")
    plain_code, plain_output = _run_sync("pass", False, True)
    if plain_code != 0:
        raise SandboxUnavailable(f"cannot start the code sandbox even without namespaces: {plain_output or plain_code}")
    logger.warning("code sandbox: namespaces unavailable (%s); allow_network: true, so code runs with rlimits "
                   "and the no-new-process filter only, with network and the host filesystem", reason)
    return False


def _check_python_is_visible_inside() -> None:
    """The sandbox mounts fresh tmpfs on /tmp and /dev/shm, so a Python (a virtualenv) installed under them cannot
    start inside it; say so, instead of the launcher's bare "No such file" read as missing namespaces."""
    for hidden in ("/tmp", "/dev/shm"):
        if os.path.abspath(sys.executable).startswith(hidden + os.sep):
            raise SandboxUnavailable(
                f"cannot build the code sandbox: this Python ({sys.executable}) is under {hidden}, which the sandbox "
                f"replaces with an empty tmpfs, so the code cannot start inside it. Run from a Python installed "
                f"outside /tmp and /dev/shm, or {_WITHOUT_NAMESPACES}")


def limits_from_config(config: dict) -> SandboxLimits:
    """SandboxLimits from the keys of a tool's `config:` block that name its fields (others are ignored here)."""
    fields = {name: config[name] for name in asdict(SandboxLimits()) if name in config}
    for name, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"sandbox config {name}={value!r}: expected a positive number")
    return SandboxLimits(**fields)
