"""Inside the sandbox: build the isolation, then run the policy's code in a process that cannot leave it.

Run by the host (hybridrl/tools/sandbox.py) as `python -I sandbox_launcher.py` with the launch spec (the code
included) as JSON on standard input. Standard library plus libseccomp (through ctypes): it must start fast and
work whatever the sandbox can import. Three processes:

- **launcher** (host namespaces): joins the call's memory cgroup, forks the namespace holder, writes its uid/gid
  maps from outside (only a process outside a user namespace may map more than its own uid), waits for it.
- **holder**: `unshare`s new user, mount, PID, network, IPC, UTS and cgroup namespaces, then forks the code
  process, which is pid 1 of the new PID namespace, and reports how it ended.
- **code process** (pid 1): builds a minimal root on tmpfs and `pivot_root`s into it, then limits itself and
  execs Python:
  1. The root holds only what the interpreter needs, bound read-only, nosuid, nodev: /usr (and the /bin, /lib
     links to it), the interpreter's prefixes, a few /etc files (ld.so cache, localtime, alternatives) and a
     generated passwd/group/hosts; the host's /root, /home, /work, /run, /var, /sys and /tmp are not there.
     `read_only_paths` from the spec add host paths, read-only, at the same place.
  2. /tmp (with the work folder /tmp/work, the code's cwd, holding main.py) and /dev/shm are one private tmpfs
     of `disk_bytes` (nosuid, nodev, bounded inodes): everything the code writes counts against it, and it dies
     with the namespace. No host folder is shared with the code, so nothing it writes outlives the call.
  3. /proc is the new PID namespace's (no host process visible); /dev holds null, zero, full, random, urandom.
  4. rlimits (soft = hard), a fresh session keyring, then the code's identity: on a root host uid/gid 1000 of
     the namespace, mapped to the host's unprivileged 65534 (nobody), with no supplementary groups, so it owns
     none of the host's files; on a non-root host the host user itself (a namespace can map only that). Every
     capability is dropped (bounding, ambient, permitted) and SECBIT_NOROOT locks execve out of granting any.
  5. A seccomp allowlist (`ALLOWED_SYSCALLS`; everything else fails with ENOSYS, the dangerous ones in
     `DENIED_SYSCALLS` with EPERM): no new processes (fork, vfork, clone without CLONE_THREAD, namespace flags),
     no io_uring, keyrings, mounts, namespaces, ptrace, bpf, perf, memfd, userfaultfd, file handles, SysV IPC,
     no AF_UNIX sockets but stream socketpairs (asyncio's self-pipe), no setuid/setgid bits or device nodes.

Without namespaces (`isolate: false`, only by the tool's explicit `unsafe_no_isolation` key) the launcher
forks the code process directly in the host's folder given by the spec, with steps 4 and 5 only.

The host kills the launcher's process group at its deadline; every process here has PR_SET_PDEATHSIG=SIGKILL,
and when pid 1 dies the kernel kills the rest of its namespace.

Exit status: the code's exit code, or 128 + signal number when a signal killed it (128 + SIGXCPU when it used
up its CPU time). 125 with "sandbox setup failed: <step>: <reason>" on stderr: the sandbox could not be built.
"""
import ctypes
import ctypes.util
import errno
import json
import os
import resource
import signal
import struct
import sys

SETUP_FAILED = 125
CODE_UID, CODE_HOST_UID = 1000, 65534  # the code's identity inside, and on a root host outside (nobody)

CLONE_NEWTIME, CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x80, 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
CLONE_THREAD = 0x00010000
NAMESPACE_FLAGS = (CLONE_NEWTIME, CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER,
                   CLONE_NEWPID, CLONE_NEWNET)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE, MNT_DETACH = 16384, 1 << 18, 2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
DEVICES = ("null", "zero", "full", "random", "urandom")  # the only device nodes the code sees
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")  # bound from the host
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # bound, or recreated as links
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 24, 28, 47, 4
# SECBIT_NOROOT (+ its lock): execve by uid 0 grants no capabilities; KEEP_CAPS_LOCKED; NO_CAP_AMBIENT_RAISE (+ lock)
NO_ROOT_SECUREBITS = (1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7)
LINUX_CAPABILITY_VERSION_3 = 0x20080522
KEYCTL_JOIN_SESSION_KEYRING = 1
SYSCALL_NUMBERS = {"x86_64": dict(pivot_root=155, mount_setattr=442, capset=126, keyctl=250),
                   "aarch64": dict(pivot_root=41, mount_setattr=442, capset=91, keyctl=219)}

# What Python, numpy and threads need, and nothing that reaches outside the process's own files and memory.
ALLOWED_SYSCALLS = """
read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 lseek sendfile copy_file_range splice tee
close close_range dup dup2 dup3 fcntl flock fsync fdatasync ftruncate truncate fallocate fadvise64
stat fstat lstat newfstatat statx statfs fstatfs access faccessat faccessat2 readlink readlinkat
getdents getdents64 getcwd chdir fchdir mkdir mkdirat rmdir rename renameat renameat2 link linkat unlink unlinkat
symlink symlinkat umask utime utimes utimensat futimesat chown fchown lchown fchownat
getxattr lgetxattr fgetxattr listxattr llistxattr flistxattr
pipe pipe2 poll ppoll select pselect6 epoll_create epoll_create1 epoll_ctl epoll_wait epoll_pwait epoll_pwait2
eventfd eventfd2 signalfd signalfd4 timerfd_create timerfd_settime timerfd_gettime
inotify_init inotify_init1 inotify_add_watch inotify_rm_watch
mmap mprotect munmap mremap madvise brk msync mincore
rt_sigaction rt_sigprocmask rt_sigreturn rt_sigsuspend rt_sigpending rt_sigtimedwait rt_sigqueueinfo
rt_tgsigqueueinfo sigaltstack pause nanosleep clock_nanosleep clock_gettime clock_getres gettimeofday time
getitimer setitimer alarm timer_create timer_settime timer_gettime timer_getoverrun timer_delete
getpid gettid getppid getuid geteuid getgid getegid getresuid getresgid getgroups getpgrp getpgid getsid
kill tgkill tkill wait4 waitid exit exit_group execve execveat restart_syscall
futex futex_waitv set_robust_list get_robust_list set_tid_address rseq membarrier arch_prctl
sched_yield sched_getaffinity sched_setaffinity sched_getparam sched_getscheduler sched_get_priority_max
sched_get_priority_min sched_rr_get_interval getpriority getcpu get_mempolicy
getrlimit setrlimit prlimit64 getrusage times sysinfo uname getrandom capget prctl ioctl
connect accept accept4 bind listen shutdown getsockname getpeername setsockopt getsockopt
sendto recvfrom sendmsg recvmsg sendmmsg recvmmsg
""".split()
# Refused with EPERM ("Operation not permitted") rather than ENOSYS: the ways out, named.
DENIED_SYSCALLS = """
fork vfork unshare setns mount umount2 pivot_root chroot move_mount open_tree fsopen fsconfig fsmount fspick
mount_setattr io_uring_setup io_uring_enter io_uring_register keyctl add_key request_key memfd_create
memfd_secret userfaultfd ptrace process_vm_readv process_vm_writev kcmp pidfd_getfd bpf perf_event_open
open_by_handle_at name_to_handle_at shmget shmat shmctl msgget msgsnd msgrcv msgctl semget semop semtimedop
semctl mq_open setuid setgid setreuid setregid setresuid setresgid setgroups setfsuid setfsgid capset
setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr init_module finit_module delete_module
kexec_load kexec_file_load reboot swapon swapoff syslog acct quotactl sethostname setdomainname settimeofday
clock_settime clock_adjtime adjtimex iopl ioperm vmsplice personality seccomp landlock_create_ruleset
""".split()
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, NETLINK_ROUTE, SOCK_TYPE_MASK, SOCK_STREAM = 1, 2, 10, 16, 0, 0xF, 1
O_CREAT, O_TMPFILE_BIT, S_ISUID, S_ISGID, S_IFMT, S_IFIFO, S_IFCHR, S_IFBLK = \
    0o100, 0o20000000, 0o4000, 0o2000, 0o170000, 0o10000, 0o20000, 0o60000
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 4, 7


def SCMP_ACT_ERRNO(number: int) -> int:  # noqa: N802 - libseccomp's macro name
    return 0x00050000 | number


libc = ctypes.CDLL(None, use_errno=True)


class SetupError(RuntimeError):
    pass


def check(result: int, what: str) -> None:
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    encode = lambda value: value.encode() if value is not None else None  # noqa: E731
    check(libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
          f"mount {source or ''} on {target}")


def set_mount_attributes(numbers: dict, path: str, attributes: int, recursive: bool) -> None:
    attr = struct.pack("QQQQ", attributes, 0, 0, 0)  # struct mount_attr {set, clr, propagation, userns_fd}
    check(libc.syscall(numbers["mount_setattr"], AT_FDCWD, path.encode(), AT_RECURSIVE if recursive else 0,
                       attr, len(attr)), f"mount_setattr({path})")


# ---------------------------------------------------------------------------------------------------- seccomp

class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def load_libseccomp():
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        seccomp = ctypes.CDLL(name, use_errno=True)
    except OSError as error:
        raise SetupError(f"libseccomp: {error} (install libseccomp2)") from error
    seccomp.seccomp_init.restype = ctypes.c_void_p
    seccomp.seccomp_init.argtypes = [ctypes.c_uint32]
    seccomp.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(ArgCmp)]
    seccomp.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    seccomp.seccomp_load.argtypes = [ctypes.c_void_p]
    return seccomp


def seccomp_rules() -> list[tuple[int, str, list[tuple[int, int, int, int]]]]:
    """(action, syscall, [(arg index, op, a, b), ...]) rules; the arguments of one rule must all match."""
    allow, eperm = SCMP_ACT_ALLOW, SCMP_ACT_ERRNO(errno.EPERM)
    masked = lambda arg, mask, value: (arg, SCMP_CMP_MASKED_EQ, mask, value)  # noqa: E731 - (arg & mask) == value
    rules = [(allow, name, []) for name in ALLOWED_SYSCALLS] + [(eperm, name, []) for name in DENIED_SYSCALLS]
    namespaces = sum(NAMESPACE_FLAGS)
    rules += [(allow, "clone", [masked(0, CLONE_THREAD | namespaces, CLONE_THREAD)]),  # threads only
              (eperm, "clone", [masked(0, CLONE_THREAD, 0)])]                          # a process
    rules += [(eperm, "clone", [masked(0, CLONE_THREAD | flag, CLONE_THREAD | flag)]) for flag in NAMESPACE_FLAGS]
    rules += [(allow, "socket", [(0, SCMP_CMP_EQ, family, 0)]) for family in (AF_INET, AF_INET6)]
    rules += [(allow, "socket", [(0, SCMP_CMP_EQ, AF_NETLINK, 0), (2, SCMP_CMP_EQ, NETLINK_ROUTE, 0)]),
              (eperm, "socket", [(0, SCMP_CMP_EQ, AF_UNIX, 0)]),  # no reaching socket paths or abstract names
              (allow, "socketpair", [(0, SCMP_CMP_EQ, AF_UNIX, 0), masked(1, SOCK_TYPE_MASK, SOCK_STREAM)])]
    # no setuid/setgid bits: chmod family (mode argument) and files created by open/openat/creat
    for name, mode in (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2), ("creat", 1)):
        rules += [(allow, name, [masked(mode, S_ISUID | S_ISGID, 0)])]
        rules += [(eperm, name, [masked(mode, bit, bit)]) for bit in (S_ISUID, S_ISGID)]
    for name, flags, mode in (("open", 1, 2), ("openat", 2, 3)):
        rules += [(allow, name, [masked(flags, O_CREAT | O_TMPFILE_BIT, 0)]),
                  (allow, name, [masked(mode, S_ISUID | S_ISGID, 0)])]
        rules += [(eperm, name, [masked(flags, O_CREAT, O_CREAT), masked(mode, bit, bit)])
                  for bit in (S_ISUID, S_ISGID)]
    for name, mode in (("mknod", 1), ("mknodat", 2)):  # FIFOs only (os.mkfifo); device nodes refused
        rules += [(allow, name, [masked(mode, S_IFMT | S_ISUID | S_ISGID, S_IFIFO)])]
        rules += [(eperm, name, [masked(mode, S_IFMT, kind)]) for kind in (S_IFCHR, S_IFBLK)]
    return rules


def install_seccomp(seccomp) -> None:
    """Load the allowlist: every syscall not allowed fails with ENOSYS (libraries then take their fallbacks, as
    glibc does from clone3 to clone), the named ways out with EPERM; another architecture's ABI (x32) kills."""
    context = seccomp.seccomp_init(SCMP_ACT_ERRNO(errno.ENOSYS))
    if not context:
        raise SetupError("seccomp_init failed")
    for action, name, conditions in seccomp_rules():
        number = seccomp.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            continue  # not a syscall of this architecture (open, fork on aarch64) or of this libseccomp
        array = (ArgCmp * max(1, len(conditions)))(*[ArgCmp(*condition) for condition in conditions])
        result = seccomp.seccomp_rule_add_array(context, action, number, len(conditions), array)
        if result != 0:
            raise SetupError(f"seccomp rule for {name}: {os.strerror(-result)}")
    result = seccomp.seccomp_load(context)  # also sets no_new_privs
    if result != 0:
        raise SetupError(f"seccomp_load: {os.strerror(-result)}")


# ------------------------------------------------------------------------------------------------ filesystem

def bind_sources(spec: dict) -> tuple[dict, dict]:
    """What the new root takes from the host: {path: O_PATH fd} to bind, {path: target} of links to recreate.
    The fds are opened before anything is mounted over the paths (the interpreter may live under /tmp)."""
    binds, links = {}, {}
    wanted = [*SYSTEM_DIRS, *spec["interpreter_paths"], *spec["read_only_paths"]]
    wanted += [f"/etc/{name}" for name in ETC_FILES] + [f"/dev/{name}" for name in DEVICES]
    for path in wanted:
        covered = any(path == done or path.startswith(done + "/") for done in (*binds, *links))
        if covered or not os.path.lexists(path):
            continue
        if os.path.islink(path) and path in SYSTEM_DIRS:
            links[path] = os.readlink(path)  # /bin -> usr/bin on merged-/usr systems
        else:
            binds[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
    return binds, links


def build_root(spec: dict, numbers: dict, code_uid: int) -> None:
    """Mount the minimal root on tmpfs, pivot into it, mount /proc; leaves cwd at the work folder /tmp/work."""
    binds, links = bind_sources(spec)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/tmp"  # where the new root is assembled: covering the host's /tmp hides it from here on
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    for folder in ("etc", "proc", "dev", "tmp", ".old_root", ".scratch"):
        os.mkdir(f"{root}/{folder}")
    write_file(f"{root}/etc/passwd", f"root:x:0:0::/:/bin/false\nsandbox:x:{code_uid}:{code_uid}::/tmp/work:"
                                     "/bin/false\n")
    write_file(f"{root}/etc/group", f"root:x:0:\nsandbox:x:{code_uid}:\n")
    write_file(f"{root}/etc/hosts", "127.0.0.1 localhost\n::1 localhost\n")
    write_file(f"{root}/etc/nsswitch.conf", "passwd: files\ngroup: files\nhosts: files dns\n")
    # one tmpfs for everything the code may write: /tmp (its work folder inside) and /dev/shm share its size
    mount("tmpfs", f"{root}/.scratch", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={spec['limits']['disk_bytes']},nr_inodes={spec['limits']['disk_inodes']},mode=1777")
    for folder in ("tmp", "shm"):
        os.mkdir(f"{root}/.scratch/{folder}", 0o1777)
        os.chmod(f"{root}/.scratch/{folder}", 0o1777)
    mount(f"{root}/.scratch/tmp", f"{root}/tmp", None, MS_BIND)
    os.mkdir(f"{root}/tmp/work", 0o700)
    write_file(f"{root}/tmp/work/main.py", spec["code"])
    for path in (f"{root}/tmp/work", f"{root}/tmp/work/main.py"):
        os.chown(path, code_uid, code_uid)
    for path, target in links.items():
        os.symlink(target, root + path)
    for path, fd in binds.items():
        if not path.startswith("/dev/"):
            bind_read_only(fd, root + path, numbers)
    minimal_dev(root, binds, numbers)
    check(libc.umount2(f"{root}/.scratch".encode(), MNT_DETACH), "umount2(.scratch)")
    for fd in binds.values():
        os.close(fd)
    check(libc.syscall(numbers["pivot_root"], root.encode(), f"{root}/.old_root".encode()), "pivot_root")
    os.chdir("/")
    # a procfs of the new PID namespace; mountable only while a full /proc is still visible (the old root's)
    mount("proc", "/proc", "proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    check(libc.umount2(b"/.old_root", MNT_DETACH), "umount2(old root)")
    for folder in ("/.old_root", "/.scratch"):
        os.rmdir(folder)
    set_mount_attributes(numbers, "/", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=False)
    os.chdir("/tmp/work")


def bind_read_only(fd: int, target: str, numbers: dict) -> None:
    """Bind what `fd` holds at `target` (made as a folder or an empty file), read-only, nosuid, nodev, with its
    submounts."""
    if os.path.isdir(f"/proc/self/fd/{fd}"):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    set_mount_attributes(numbers, target, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV, recursive=True)


def minimal_dev(root: str, binds: dict, numbers: dict) -> None:
    dev = f"{root}/dev"
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        mount(f"/proc/self/fd/{binds[f'/dev/{name}']}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    os.mkdir(f"{dev}/shm")
    mount(f"{root}/.scratch/shm", f"{dev}/shm", None, MS_BIND)
    set_mount_attributes(numbers, dev, MOUNT_ATTR_RDONLY, recursive=False)


# ------------------------------------------------------------------------------------------------ identity

def set_limits(limits: dict) -> None:
    """soft = hard for every limit. CPU: the kernel sends SIGKILL at the hard limit; SIGXCPU at the soft one
    would be ignored, because the code runs as pid 1 of its namespace, which is shielded from it."""
    for name, key in (("RLIMIT_CPU", "cpu_time_s"), ("RLIMIT_AS", "memory_bytes"),
                      ("RLIMIT_FSIZE", "file_size_bytes"), ("RLIMIT_NOFILE", "open_files"),
                      ("RLIMIT_NPROC", "processes")):
        resource.setrlimit(getattr(resource, name), (limits[key], limits[key]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def become_code_user(numbers: dict, code_uid: int) -> None:
    """A fresh session keyring, no capabilities now or after execve, then the code's uid and gid.

    The bounding set needs CAP_SETPCAP to shrink, so it goes first; switching from uid 0 to `code_uid` clears
    the permitted and effective sets (no SECBIT_KEEP_CAPS), and capset empties whatever remains."""
    if libc.syscall(numbers["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        raise SetupError(f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(ctypes.get_errno())}")
    check(libc.prctl(PR_SET_SECUREBITS, NO_ROOT_SECUREBITS, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_capability = int(f.read())
    for capability in range(last_capability + 1):
        check(libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {capability})")
    check(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    if code_uid != os.getuid():
        os.setgroups([])
        os.setresgid(code_uid, code_uid, code_uid)
        os.setresuid(code_uid, code_uid, code_uid)
    header = struct.pack("Ii", LINUX_CAPABILITY_VERSION_3, 0)
    check(libc.syscall(numbers["capset"], header, bytes(24)), "capset(no capabilities)")  # all three sets empty


# ------------------------------------------------------------------------------------------------ processes

def run_code(spec: dict, seccomp, numbers: dict, code_uid: int) -> None:
    """In the code process: build its world, limit it, exec Python. Never returns."""
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if spec["isolate"]:
            build_root(spec, numbers, code_uid)
            libc.sethostname(b"sandbox", 7)
        else:
            write_file("main.py", spec["code"])  # in the host folder the host made for this call
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        set_limits(spec["limits"])
        if spec["isolate"] or os.geteuid() == 0:  # a non-root process outside namespaces holds no capability
            become_code_user(numbers, code_uid)
        install_seccomp(seccomp)
        cwd = os.getcwd()
        os.execve(spec["python"], [spec["python"], "-I", "-u", "main.py"], {**spec["env"], "HOME": cwd, "TMPDIR": cwd})
    except BaseException as error:  # noqa: BLE001 - report any setup failure, then leave
        print(f"sandbox setup failed: {error}", file=sys.stderr)
    os._exit(SETUP_FAILED)


def wait_for_code(pid: int, cpu_time_s: int) -> int:
    """The code process's exit code, 128 + signal, or 128 + SIGXCPU when the CPU-time limit killed it."""
    _, status, usage = os.wait4(pid, 0)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    if os.WTERMSIG(status) in (signal.SIGKILL, signal.SIGXCPU) and usage.ru_utime + usage.ru_stime >= cpu_time_s - 0.05:
        return 128 + signal.SIGXCPU
    return 128 + os.WTERMSIG(status)


def fork_code(spec: dict, seccomp, numbers: dict, code_uid: int) -> int:
    pid = os.fork()
    if pid == 0:
        run_code(spec, seccomp, numbers, code_uid)
    return wait_for_code(pid, spec["limits"]["cpu_time_s"])


def hold_namespaces(spec: dict, seccomp, numbers: dict, code_uid: int, ready: int, mapped: int) -> int:
    """The holder: new namespaces, wait until the launcher has written its maps, then run the code as pid 1."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
    if not spec["allow_network"]:
        flags |= CLONE_NEWNET
    try:
        check(libc.unshare(flags), f"unshare({flags:#x}) (user, mount, PID, IPC, UTS, cgroup"
                                   f"{'' if spec['allow_network'] else ', network'} namespaces)")
    except SetupError as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        return SETUP_FAILED
    os.write(ready, b"u")
    if os.read(mapped, 1) != b"m":
        return SETUP_FAILED  # the launcher reported why
    return fork_code(spec, seccomp, numbers, code_uid)


def write_id_maps(pid: int, host_uid: int, host_gid: int) -> None:
    """A root host maps namespace root to itself (to build the root) and the code's uid to `nobody`; any other
    user can map only itself, as namespace root, and must deny setgroups first."""
    if host_uid == 0:
        write_file(f"/proc/{pid}/uid_map", f"0 0 1\n{CODE_UID} {CODE_HOST_UID} 1\n")
        write_file(f"/proc/{pid}/gid_map", f"0 0 1\n{CODE_UID} {CODE_HOST_UID} 1\n")
    else:
        write_file(f"/proc/{pid}/setgroups", "deny")
        write_file(f"/proc/{pid}/uid_map", f"0 {host_uid} 1\n")
        write_file(f"/proc/{pid}/gid_map", f"0 {host_gid} 1\n")


def run_isolated(spec: dict, seccomp, numbers: dict) -> int:
    ready_read, ready_write = os.pipe()
    mapped_read, mapped_write = os.pipe()
    host_uid, host_gid = os.geteuid(), os.getegid()
    code_uid = CODE_UID if host_uid == 0 else 0  # see write_id_maps
    holder = os.fork()
    if holder == 0:
        os.close(ready_read)
        os.close(mapped_write)
        os._exit(hold_namespaces(spec, seccomp, numbers, code_uid, ready_write, mapped_read))
    os.close(ready_write)
    os.close(mapped_read)
    if os.read(ready_read, 1) == b"u":
        try:
            write_id_maps(holder, host_uid, host_gid)
            os.write(mapped_write, b"m")
        except OSError as error:
            print(f"sandbox setup failed: uid/gid maps of the user namespace: {error}", file=sys.stderr)
    os.close(mapped_write)
    _, status = os.waitpid(holder, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def join_cgroup(folder: str) -> None:
    """Move this process (and so everything it starts) into the call's memory cgroup, made by the host."""
    write_file(os.path.join(folder, "cgroup.procs"), str(os.getpid()))


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    numbers = SYSCALL_NUMBERS.get(os.uname().machine)
    try:
        if numbers is None:
            raise SetupError(f"no syscall table for architecture {os.uname().machine!r} (x86_64 and aarch64 only)")
        seccomp = load_libseccomp()
        if spec["cgroup"]:
            join_cgroup(spec["cgroup"])
    except (SetupError, OSError) as error:
        print(f"sandbox setup failed: {error}", file=sys.stderr)
        return SETUP_FAILED
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: os._exit(128 + signal.SIGKILL))  # PDEATHSIG then kills the rest
    if spec["isolate"]:
        return run_isolated(spec, seccomp, numbers)
    return fork_code(spec, seccomp, numbers, os.getuid())


if __name__ == "__main__":
    sys.exit(main())
