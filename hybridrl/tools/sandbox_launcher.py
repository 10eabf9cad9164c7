"""Inside the sandbox: isolate this process, then run the user's code in a child that cannot escape.

Run by the host (hybridrl/tools/sandbox.py) as `python -I sandbox_launcher.py SPEC.json`, with the
private work directory as cwd. Standard library only: it must start fast and work whatever the
sandbox can import (it runs before the limits and filters it installs).

Steps, each a kernel mechanism, none needing root:
1. `unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID)` and map our own uid/gid
   into the new user namespace (an unprivileged process may map exactly itself). A new network
   namespace holds only a down loopback: `connect()` fails with ENETUNREACH, no name resolves.
2. Mount namespace: every mount read-only (`mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY)`), the
   work directory bind-mounted back read-write, fresh size-limited tmpfs on /tmp and /dev/shm, a
   /dev with only null/zero/full/random/urandom, and (step 3) a read-only /proc. The code can read
   world-readable files but write only its cwd and its own /tmp. This matters when the host runs as
   root: the code is then kuid 0, the owner of root's files, disks and sysctls.
3. PID namespace: the child is pid 1 of a namespace that sees no host process (it mounts its own
   /proc), so it cannot signal or ptrace the trainer, which the shared uid would otherwise allow.
   It has PR_SET_PDEATHSIG = SIGKILL: when the host kills this launcher, the kernel kills pid 1 and
   with it everything in the namespace; when pid 1 exits, anything it left behind dies too.
4. rlimits, soft = hard (CPU seconds: SIGKILL when used up, address space, file size, open files,
   processes, no core dumps) and a seccomp filter that refuses AF_UNIX sockets (the host's socket
   files: Docker's, Ray's) and new processes: fork/vfork and clone without CLONE_THREAD get EPERM,
   clone3 gets ENOSYS (glibc then falls back to clone for threads). RLIMIT_NPROC alone does not
   stop a fork bomb when the host runs as root (the kernel exempts uid 0), the filter does; threads
   stay possible (bounded by RLIMIT_AS and, for non-root hosts, RLIMIT_NPROC).
5. No capabilities (securebits NOROOT, empty bounding/ambient/current sets): the code cannot undo
   steps 2-4 (remount read-write, unmount /tmp), even when it is uid 0 of its namespace.

Exit status: the child's exit code, or 128 + signal number when a signal killed it, 128 + SIGXCPU
when it was killed having used up its CPU time. Exit 125 with "sandbox setup failed: ..." on
stderr: the sandbox itself could not be built (the host's probe turns that into a refusal).
"""
import ctypes
import json
import os
import platform
import resource
import signal
import struct
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
CLONE_THREAD = 0x00010000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
AF_UNIX = 1
DEVICES = ("null", "zero", "full", "random", "urandom")  # the only device nodes the code sees
AT_RECURSIVE, MOUNT_ATTR_RDONLY = 0x8000, 0x1
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
# SECBIT_NOROOT (+ its lock): execve by uid 0 grants no capabilities; KEEP_CAPS_LOCKED; NO_CAP_AMBIENT_RAISE (+ lock)
NO_ROOT_SECUREBITS = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7)
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SETUP_FAILED = 125

# Per architecture: audit arch and syscall numbers (fork/vfork None: the architecture has only clone).
ARCHES = {
    "x86_64": dict(audit=0xC000003E, mount_setattr=442, capset=126, socket=41, clone=56, clone3=435, fork=57,
                   vfork=58),
    "aarch64": dict(audit=0xC00000B7, mount_setattr=442, capset=91, socket=198, clone=220, clone3=435, fork=None,
                    vfork=None),
}

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(RuntimeError):
    pass


def check(result: int, what: str) -> None:
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(flags: int) -> None:
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(flags), f"unshare({flags:#x})")
    write_file("/proc/self/setgroups", "deny")
    write_file("/proc/self/uid_map", f"{uid} {uid} 1")
    write_file("/proc/self/gid_map", f"{gid} {gid} 1")


def mount(source, target, fstype, flags: int, data) -> None:
    encode = lambda value: value.encode() if value is not None else None  # noqa: E731
    check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
          f"mount {source} on {target}")


def read_only_filesystem(workdir: str, tmpfs_bytes: int, arch: dict) -> str:
    """Every mount read-only; fresh tmpfs on /tmp; a minimal /dev; `workdir` bound read-write at /tmp/work.

    Returns the new cwd. The host's /tmp (Ray's sockets, other runs' files) is hidden by the tmpfs,
    and its /dev (disks, consoles, kmsg) by a /dev holding only DEVICES, fd links and its own shm.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    attr = struct.pack("QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0)  # struct mount_attr {set, clr, propagation, userns_fd}
    check(libc.syscall(arch["mount_setattr"], -100, b"/", AT_RECURSIVE, attr, len(attr)),
          "mount_setattr(/, read-only, recursive)")
    # O_PATH handles stay usable once the paths are covered by the new mounts below
    workdir_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY)
    device_fds = {name: os.open(f"/dev/{name}", os.O_PATH) for name in DEVICES}
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_bytes},mode=1777")
    minimal_dev(device_fds, tmpfs_bytes)
    inside = "/tmp/work"
    os.mkdir(inside)
    mount(f"/proc/self/fd/{workdir_fd}", inside, None, MS_BIND, None)
    mount(None, inside, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, None)  # read-write again
    for fd in (workdir_fd, *device_fds.values()):
        os.close(fd)
    os.chdir(inside)
    return inside


def minimal_dev(device_fds: dict, shm_bytes: int) -> None:
    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=65536,mode=755")
    for name, fd in device_fds.items():
        open(f"/dev/{name}", "w").close()
        mount(f"/proc/self/fd/{fd}", f"/dev/{name}", None, MS_BIND, None)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")
    os.mkdir("/dev/shm")
    mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={shm_bytes},mode=1777")
    mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "size=65536,mode=755")


def set_limits(limits: dict) -> None:
    """soft = hard for every limit. CPU: the kernel sends SIGKILL at the hard limit; SIGXCPU at the soft one
    would be ignored, because the code runs as pid 1 of its namespace, which is shielded from it."""
    for name, key in (("RLIMIT_CPU", "cpu_time_s"), ("RLIMIT_AS", "memory_bytes"),
                      ("RLIMIT_FSIZE", "file_size_bytes"), ("RLIMIT_NOFILE", "open_files"),
                      ("RLIMIT_NPROC", "processes")):
        resource.setrlimit(getattr(resource, name), (limits[key], limits[key]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def drop_capabilities(arch: dict) -> None:
    """No capabilities, now or after execve, even as uid 0 of the user namespace.

    The namespace's creator holds every capability inside it; when the host runs as root the code
    is uid 0 there, and execve would grant them all again. With them it could remount / read-write,
    unmount the private /tmp and, as owner of root's files, write the host's. NOROOT securebits stop
    execve's grant; the bounding, ambient and current sets are emptied."""
    check(libc.prctl(PR_SET_SECUREBITS, NO_ROOT_SECUREBITS, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_capability = int(f.read())
    for capability in range(last_capability + 1):
        check(libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {capability})")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    header = struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all zero
    check(libc.syscall(arch["capset"], header, data), "capset(no capabilities)")


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def seccomp_program(arch: dict) -> list[tuple[int, int, int, int]]:
    """BPF (code, jump-if-true, jump-if-false, k) instructions, assembled from a labelled listing.

    Refused: processes (fork, vfork, clone without CLONE_THREAD: EPERM; clone3: ENOSYS, which makes
    glibc fall back to clone for threads), AF_UNIX sockets (EPERM: no connecting to the host's
    socket files; socketpair, which asyncio uses, stays allowed), and any other architecture's ABI.
    """
    LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL, EPERM, ENOSYS = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38
    NR, ARCH, ARG0 = 0, 4, 16  # offsets in struct seccomp_data (ARG0: its low 32 bits, little-endian)
    listing = [(LD_ABS, 0, 0, ARCH), (JEQ, 0, "kill", arch["audit"]), (LD_ABS, 0, 0, NR)]
    if arch["audit"] == ARCHES["x86_64"]["audit"]:
        listing.append((JGE, "eperm", 0, 0x40000000))  # the x32 ABI's syscalls share x86_64's audit arch
    listing += [(JEQ, "clone", 0, arch["clone"]), (JEQ, "enosys", 0, arch["clone3"]),
                (JEQ, "socket", 0, arch["socket"])]
    listing += [(JEQ, "eperm", 0, number) for number in (arch["fork"], arch["vfork"]) if number is not None]
    listing += [(RET, 0, 0, ALLOW),
                "clone", (LD_ABS, 0, 0, ARG0), (JSET, "allow", "eperm", CLONE_THREAD),
                "socket", (LD_ABS, 0, 0, ARG0), (JEQ, "eperm", "allow", AF_UNIX),
                "allow", (RET, 0, 0, ALLOW), "eperm", (RET, 0, 0, EPERM), "enosys", (RET, 0, 0, ENOSYS),
                "kill", (RET, 0, 0, KILL)]
    return assemble(listing)


def assemble(listing: list) -> list[tuple[int, int, int, int]]:
    """Resolve label names (strings in the listing, and as jump targets) to BPF's relative jumps."""
    labels, position = {}, 0
    for item in listing:
        if isinstance(item, str):
            labels[item] = position
        else:
            position += 1
    program = []
    for item in listing:
        if isinstance(item, str):
            continue
        code, jump_true, jump_false, k = item
        here = len(program) + 1  # jumps count from the next instruction
        resolve = lambda jump: labels[jump] - here if isinstance(jump, str) else jump  # noqa: E731
        program.append((code, resolve(jump_true), resolve(jump_false), k))
    return program


def forbid_new_processes(arch: dict) -> None:
    """Install the seccomp filter (inherited across execve; NO_NEW_PRIVS lets a non-root process do it)."""
    program = seccomp_program(arch)
    filters = (SockFilter * len(program))(*[SockFilter(*instruction) for instruction in program])
    fprog = SockFprog(len(program), filters)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def run_child(spec: dict, arch: dict) -> None:
    """In the forked child (pid 1 of the new PID namespace when one was made): limits, filter, exec."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if spec["namespaces"]:  # a procfs of the new PID namespace: host processes disappear from /proc
        mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)  # no sysctl writes
    set_limits(spec["limits"])
    if spec["namespaces"] or os.geteuid() == 0:  # a non-root process outside namespaces holds none
        drop_capabilities(arch)
    forbid_new_processes(arch)
    os.execve(spec["python"], [spec["python"], "-I", "-u", spec["script"]], spec["env"])


def main() -> int:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    os.unlink(sys.argv[1])  # the code sees only its main.py
    arch = ARCHES.get(platform.machine())
    try:
        if arch is None:
            raise SetupError(f"no seccomp table for architecture {platform.machine()!r}")
        if spec["namespaces"]:
            flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | (0 if spec["allow_network"] else CLONE_NEWNET)
            enter_namespaces(flags)
            cwd = read_only_filesystem(os.getcwd(), spec["limits"]["tmpfs_bytes"], arch)
            spec["env"].update(HOME=cwd, TMPDIR=cwd)
    except (SetupError, OSError) as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        return SETUP_FAILED
    child = os.fork()
    if child == 0:
        try:
            run_child(spec, arch)
        except BaseException as error:  # noqa: BLE001 - report any setup failure, then leave
            print(f"sandbox setup failed: {error}", file=sys.stderr)
        os._exit(SETUP_FAILED)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: os._exit(128 + signal.SIGKILL))  # PDEATHSIG then kills the child
    _, status, usage = os.wait4(child, 0)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    cpu_seconds = usage.ru_utime + usage.ru_stime
    if os.WTERMSIG(status) in (signal.SIGKILL, signal.SIGXCPU) and cpu_seconds >= spec["limits"]["cpu_time_s"] - 0.05:
        return 128 + signal.SIGXCPU  # killed by the CPU-time limit
    return 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main())
