"""Host side of the code sandbox: run one Python snippet in a fresh, isolated, limited process.

The sandbox runs code a policy wrote, so it treats that code as hostile (the launcher's docstring lists the
layers): no host folder is shared with it (the code and the launch spec go in on the launcher's standard input;
the work folder is a tmpfs inside the sandbox that dies with it), it runs as an unprivileged user in a minimal
read-only root, under a seccomp allowlist, in new namespaces, with rlimits and, where this process may make
cgroups, a memory cgroup that also counts what it writes to its tmpfs.

`python -I sandbox_launcher.py` starts in its own session (process group) with a minimal environment. The
host enforces the wall clock: past `timeout_s`, or when the awaiting task is cancelled (e.g. by
`run_tool_call`'s timeout), it SIGKILLs the launcher's process group; every process of the sandbox dies with it.
Cleanup then checks that nothing is left (processes, the cgroup, the work folder of an unisolated run) and
counts what is, instead of raising.

Isolation is never lowered silently: where the kernel cannot build the sandbox, `probe_isolation` refuses with
the step that failed. Only `unsafe_no_isolation` runs code without namespaces (rlimits and the seccomp filter
only: the host's files, processes and network are open to it), and every such call logs a warning.

stdout and stderr share one pipe (interleaved as written: the code runs unbuffered). The host keeps at most
`max_output_bytes` from the head and as many from the tail and drains the rest, so a process printing
gigabytes costs neither host memory nor a blocked pipe.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace

logger = logging.getLogger(__name__)

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
SETUP_FAILED = 125  # the launcher's exit code when it could not build the sandbox (sandbox_launcher.SETUP_FAILED)
MINIMAL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
CGROUP_PREFIX = "hybridrl-sandbox-"
CGROUP_SLACK_BYTES = 64 << 20  # the interpreter's own pages and the kernel's, on top of memory + disk


@dataclass(frozen=True)
class SandboxLimits:
    """Per-call limits; the code interpreter tool reads them from its YAML `config:` block."""
    timeout_s: float = 10.0                 # wall clock, host-enforced: SIGKILL of the whole process group
    cpu_time_s: int = 5                     # RLIMIT_CPU: SIGKILL at this many CPU seconds (exit 128+SIGXCPU)
    memory_mb: int = 1024                   # RLIMIT_AS: allocations beyond fail (MemoryError in Python)
    file_size_mb: int = 16                  # RLIMIT_FSIZE: a larger write fails (EFBIG)
    disk_mb: int = 64                       # the private tmpfs (/tmp, the work folder, /dev/shm) in all (ENOSPC)
    open_files: int = 64                    # RLIMIT_NOFILE
    processes: int = 32                     # RLIMIT_NPROC (threads count); new processes are refused anyway
    max_output_bytes: int = 1 << 20         # bytes kept from each end of the output

    def launcher_limits(self) -> dict:
        mib = 1 << 20
        return {"cpu_time_s": max(1, math.ceil(self.cpu_time_s)), "memory_bytes": int(self.memory_mb * mib),
                "file_size_bytes": int(self.file_size_mb * mib), "disk_bytes": int(self.disk_mb * mib),
                "disk_inodes": 4096, "open_files": int(self.open_files), "processes": int(self.processes)}

    def cgroup_bytes(self) -> int:
        return int((self.memory_mb + self.disk_mb) * (1 << 20)) + CGROUP_SLACK_BYTES


@dataclass(frozen=True)
class SandboxAccess:
    """What the code may reach beyond its own tmpfs; the tool's YAML keys of the same names."""
    allow_network: bool = False             # share the host's network namespace (the host's TCP/UDP services too)
    read_only_paths: tuple[str, ...] = ()   # host paths bound read-only at the same place (data for the code)
    unsafe_no_isolation: bool = False       # no namespaces at all: host files, processes and network open


@dataclass
class SandboxResult:
    """What one call did. exit_code: the code's exit status, or 128 + signal when a signal ended it.
    leftovers: what cleanup could not remove (processes, the cgroup, entries of an unisolated work folder)."""
    output: str
    exit_code: int | None
    timed_out: bool
    wall_s: float
    output_bytes: int
    leftovers: int = 0

    @property
    def signal_name(self) -> str | None:
        if self.exit_code is None or self.exit_code <= 128 or self.exit_code == SETUP_FAILED:
            return None
        try:
            return signal.Signals(self.exit_code - 128).name
        except ValueError:
            return None


class SandboxUnavailable(RuntimeError):
    """The kernel refused the isolation the config asks for (namespaces, mounts, seccomp or libseccomp)."""


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


def interpreter_paths() -> list[str]:
    """Folders the sandboxed Python needs: its prefixes (a virtualenv and the Python it was made from)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(os.path.abspath(path) for path in paths)


def launch_spec(code: str, limits: SandboxLimits, access: SandboxAccess, cgroup: str | None) -> bytes:
    return json.dumps({
        "code": code, "python": sys.executable, "env": MINIMAL_ENV, "isolate": not access.unsafe_no_isolation,
        "allow_network": access.allow_network, "read_only_paths": list(access.read_only_paths),
        "interpreter_paths": interpreter_paths(), "limits": limits.launcher_limits(), "cgroup": cgroup,
    }).encode()


# ------------------------------------------------------------------------------------------------ cgroups

@functools.cache  # a process keeps its cgroup: found once, not at every call
def memory_cgroup_root() -> str | None:
    """This process's own memory cgroup folder (v2 unified or v1 `memory`), where it may make children; None
    where there is none or it is not writable (then RLIMIT_AS and the tmpfs size bound the code alone)."""
    try:
        with open("/proc/self/cgroup") as f:
            memberships = dict(line.rstrip("\n").split(":", 2)[1:] for line in f if line.count(":") >= 2)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for fields_ in mounts:
        separator = fields_.index("-")
        fstype, options = fields_[separator + 1], fields_[-1].split(",")
        if fstype == "cgroup2" and "" in memberships:
            own = memberships[""]
        elif fstype == "cgroup" and "memory" in options and "memory" in memberships:
            own = memberships["memory"]
        else:
            continue
        mount_root, mount_point = fields_[3], fields_[4]
        if not own.startswith(mount_root):
            continue
        folder = os.path.normpath(mount_point + "/" + own[len(mount_root):])
        limit_file = "memory.max" if fstype == "cgroup2" else "memory.limit_in_bytes"
        if fstype == "cgroup2":  # children get a memory controller only where this one hands it down
            try:
                with open(os.path.join(folder, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        continue
            except OSError:
                continue
        elif not os.path.exists(os.path.join(folder, limit_file)):
            continue
        if os.access(folder, os.W_OK):
            return folder
    return None


def make_cgroup(root: str, limit_bytes: int) -> str:
    """A child cgroup capping memory (v2: memory.max, no swap; v1: limit_in_bytes and memsw where present)."""
    folder = os.path.join(root, CGROUP_PREFIX + uuid.uuid4().hex[:12])
    os.mkdir(folder)
    settings = ([("memory.max", limit_bytes), ("memory.swap.max", 0)] if os.path.exists(f"{folder}/memory.max")
                else [("memory.limit_in_bytes", limit_bytes), ("memory.memsw.limit_in_bytes", limit_bytes)])
    for name, value in settings:
        if os.path.exists(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "w") as f:
                f.write(str(value))
    return folder


def remove_cgroup(folder: str) -> int:
    """Kill what is left in the cgroup and remove it; 1 when it (or a process in it) stays, else 0."""
    deadline = time.monotonic() + 2
    while True:
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                pids = [int(pid) for pid in f.read().split()]
        except FileNotFoundError:
            return 0
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(folder)
            return 0
        except FileNotFoundError:
            return 0
        except OSError:
            if time.monotonic() > deadline:
                logger.warning("sandbox cgroup %s could not be removed (%d processes in it)", folder, len(pids))
                return 1
            time.sleep(0.02)


def remove_stale_cgroups(root: str | None, older_than_s: float = 600) -> None:
    """Runs killed mid-call leave empty cgroups behind; remove those older than any call (a fresh one may be
    another process's, about to be joined; rmdir refuses non-empty ones)."""
    if root is None:
        return
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        try:
            if name.startswith(CGROUP_PREFIX) and time.time() - os.stat(folder).st_mtime > older_than_s:
                os.rmdir(folder)
        except OSError:
            pass


# ------------------------------------------------------------------------------------------------ cleanup

def remove_tree(path: str) -> int:
    """Delete folder `path` without following a link and without raising; returns how many entries stay.

    Sub-folders are moved up into `path` itself before they are emptied, so the walk needs no recursion and
    one open folder at a time, however deep the tree (Python's rmtree raises RecursionError on a deep one)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    try:
        top = os.open(path, flags)
    except FileNotFoundError:
        return 0
    except OSError:
        return 1
    left, pending, names = 0, ["."], itertools.count()
    try:
        while pending:
            name = pending.pop()
            try:
                folder = os.open(name, flags, dir_fd=top)
            except OSError:
                left += 1
                continue
            try:
                os.fchmod(folder, 0o700)
                for entry in list(os.scandir(folder)):
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            flat = _unused_name(top, names)
                            os.rename(entry.name, flat, src_dir_fd=folder, dst_dir_fd=top)
                            pending.append(flat)
                        else:
                            os.unlink(entry.name, dir_fd=folder)
                    except OSError:
                        left += 1
            except OSError:
                left += 1
            finally:
                os.close(folder)
            if name != ".":
                try:
                    os.rmdir(name, dir_fd=top)
                except OSError:
                    left += 1
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        left += 1
    return left


def _unused_name(top: int, names) -> str:
    while True:
        name = f".removing-{next(names)}"
        try:
            os.stat(name, dir_fd=top, follow_symlinks=False)
        except FileNotFoundError:
            return name


def _kill_group(process) -> None:
    """SIGKILL the launcher's process group (start_new_session: its pid is the group id). Only while the
    launcher is unreaped: once reaped, its pid, and so that group id, may already belong to someone else."""
    if process.returncode is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _reap(process) -> None:
    """Read the killed process's pipe to EOF and wait for it, so its transport closes on this loop."""
    try:
        await asyncio.wait_for(process.communicate(), timeout=5)
    except (asyncio.TimeoutError, OSError, ValueError):
        logger.warning("sandbox process %d not reaped within 5 s of SIGKILL", process.pid)


async def _feed_and_drain(process, spec: bytes, output: _BoundedOutput) -> None:
    try:
        process.stdin.write(spec)
        await process.stdin.drain()
        process.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the launcher died before reading its spec; its output says why
    while chunk := await process.stdout.read(1 << 16):
        output.add(chunk)
    await process.wait()


async def run_python(code: str, limits: SandboxLimits, access: SandboxAccess = SandboxAccess()) -> SandboxResult:
    """Run `code` once in the sandbox; never raises for anything the code does."""
    started = time.monotonic()
    cgroup_root = None if access.unsafe_no_isolation else memory_cgroup_root()
    try:
        cgroup = make_cgroup(cgroup_root, limits.cgroup_bytes()) if cgroup_root else None
    except OSError as error:
        raise SandboxUnavailable(f"cannot make the sandbox's memory cgroup under {cgroup_root}: {error}") from error
    workdir = None
    if access.unsafe_no_isolation:
        logger.warning("code sandbox: unsafe_no_isolation is set, so this call runs with rlimits and the seccomp "
                       "filter only: the host's files, processes and network are open to the code")
        workdir = tempfile.mkdtemp(prefix="hybridrl-sandbox-")
    leftovers = 0
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-I", LAUNCHER, cwd=workdir or "/", env=dict(MINIMAL_ENV), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        output = _BoundedOutput(limits.max_output_bytes)
        timed_out = False
        try:
            await asyncio.wait_for(_feed_and_drain(process, launch_spec(code, limits, access, cgroup), output),
                                   timeout=limits.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
        finally:  # also on cancellation: nothing of this call outlives it, and the pipe is closed
            _kill_group(process)
            await _reap(process)
        exit_code = None if timed_out else process.returncode
        result = SandboxResult(output=output.text(), exit_code=exit_code, timed_out=timed_out,
                               wall_s=time.monotonic() - started, output_bytes=output.total)
    finally:
        leftovers += remove_cgroup(cgroup) if cgroup else 0
        leftovers += remove_tree(workdir) if workdir else 0
    result.leftovers = leftovers
    if leftovers:
        logger.warning("code sandbox: %d things were left behind after a call", leftovers)
    return result


# ------------------------------------------------------------------------------------------------ probing

def probe_isolation(limits: SandboxLimits, access: SandboxAccess) -> None:
    """Check once, at tool creation, that the full sandbox can be built here; raise SandboxUnavailable naming
    the step that failed (and how to allow it) instead of ever running the code with less isolation."""
    remove_stale_cgroups(memory_cgroup_root())
    if access.unsafe_no_isolation:
        logger.warning("code sandbox: unsafe_no_isolation is set: every call runs without namespaces (host files, "
                       "processes and network open to the code)")
        return
    probe = "import os\nprint(os.getcwd(), os.getuid())\n"
    with ThreadPoolExecutor(1) as pool:  # its own event loop, whether or not the caller runs one
        result = pool.submit(asyncio.run, run_python(probe, replace(limits, timeout_s=30), access)).result()
    expected_uid = 1000 if os.geteuid() == 0 else 0  # sandbox_launcher.CODE_UID; that script is not imported here
    if result.exit_code == 0 and result.output == f"/tmp/work {expected_uid}\n":
        return
    reason = result.output.strip() or f"exit code {result.exit_code}"
    raise SandboxUnavailable(
        f"cannot build the code sandbox: {reason}. It needs Linux >= 5.12 with unprivileged user namespaces "
        "(sysctls user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, "
        "kernel.apparmor_restrict_unprivileged_userns=0), a /proc without masked paths (in Docker: "
        "--security-opt seccomp=unconfined --security-opt systempaths=unconfined, or run the trainer outside "
        "the container's default profile) and libseccomp2. Code is never run with less isolation unless the "
        "tool's config sets unsafe_no_isolation: true")


def limits_from_config(config: dict) -> SandboxLimits:
    """SandboxLimits from the keys of a tool's `config:` block that name its fields (others are ignored here)."""
    values = {item.name: config[item.name] for item in fields(SandboxLimits) if item.name in config}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"sandbox config {name}={value!r}: expected a positive number")
    return SandboxLimits(**values)


def access_from_config(config: dict) -> SandboxAccess:
    """SandboxAccess from a tool's `config:` block; refuses values of the wrong type, naming the key."""
    for name in ("allow_network", "unsafe_no_isolation"):
        if not isinstance(config.get(name, False), bool):
            raise ValueError(f"sandbox config {name}={config[name]!r}: expected true or false")
    paths = config.get("read_only_paths", [])
    if not isinstance(paths, (list, tuple)) or not all(isinstance(path, str) for path in paths):
        raise ValueError(f"sandbox config read_only_paths={paths!r}: expected a list of absolute paths")
    for path in paths:
        if not os.path.isabs(path) or not os.path.exists(path):
            raise ValueError(f"sandbox config read_only_paths: {path!r} is not an existing absolute path")
    return SandboxAccess(allow_network=config.get("allow_network", False), read_only_paths=tuple(paths),
                         unsafe_no_isolation=config.get("unsafe_no_isolation", False))
