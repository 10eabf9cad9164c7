"""Hostile code against the code sandbox, through the tool's own entry point, as a policy under RL pressure would
try it: persistence, disk, sockets, secrets, memory, privilege and namespaces, processes, downgrade.

Each test asserts that the attack is blocked (the errno or signal the layer that stops it gives) and, through
the autouse `host_unchanged` fixture, that nothing of it is left on the host: no file the code's host identity
owns or an attack names in the host's temp folders, no sandbox process, no sandbox cgroup, and the tool's
`leftovers` metric 0. Where the kernel lacks what a test needs, it skips saying so."""
import asyncio
import ctypes
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from hybridrl.tools import sandbox as sandbox_module
from hybridrl.tools.code_interpreter_tool import CodeInterpreterTool
from hybridrl.tools.sandbox import CGROUP_PREFIX, SandboxLimits, interpreter_paths, memory_cgroup_root, remove_tree
from test_sandbox import NO_SANDBOX, SCHEMA, sandbox_processes

pytestmark = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"no code sandbox here: {NO_SANDBOX}")

# timeout_s: a wall-clock limit a loaded machine cannot reach in an attack that must finish (a trivial call took up
# to 2.5 s at a 1-minute load of 14-24 on 2 cores; 1 s of CPU took 8.7 s)
LIMITS = {"timeout_s": 60, "cpu_time_s": 3, "memory_mb": 512, "file_size_mb": 16, "disk_mb": 32,
          "max_tool_response_length": 4000}
ROOT_HOST = os.geteuid() == 0
CODE_HOST_UID = 65534  # the code's uid on a root host (sandbox_launcher.CODE_HOST_UID)
MARK = "hybridrl-attack"  # every file an attack plants carries it in its name
HOST_TEMP = sorted({tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"})


def searchable(folder: str, read_only_inside: set[str]) -> bool:
    """Whether the trace descends into `folder`. Not into the interpreter's folders, bound read-only inside. On a root
    host the code is uid 65534 with no groups and no capabilities (asserted below), which can make entries only in
    folders it owns or that everybody may write: the suite's own root-only folders (pytest's, Ray's, a clone's: tens
    of thousands of files, 2 s a walk) are skipped, the sandbox's work folders and an attack's named ones never.
    Elsewhere the code runs as the caller and every folder is searched."""
    if folder in read_only_inside:
        return False
    name = os.path.basename(folder)
    if not ROOT_HOST or MARK in name or name.startswith("hybridrl-sandbox-"):
        return True
    try:
        status = os.lstat(folder)
    except OSError:  # gone meanwhile
        return False
    return status.st_uid == CODE_HOST_UID or bool(status.st_mode & stat.S_IWOTH)


def host_trace() -> dict:
    """What a call could leave on the host: files in its temp folders that the code's host uid owns or an
    attack named, the sandbox's processes (and any process of that uid), its cgroups."""
    files = []
    read_only_inside = set(interpreter_paths())  # bound read-only: nothing can be planted there (a venv is big)
    for top in HOST_TEMP:
        for folder, subfolders, names in os.walk(top):
            subfolders[:] = [name for name in subfolders if searchable(os.path.join(folder, name), read_only_inside)]
            for name in names + subfolders:
                path = os.path.join(folder, name)
                try:
                    owner = os.lstat(path).st_uid
                except OSError:
                    continue
                if MARK in name or name.startswith("hybridrl-sandbox-") or (ROOT_HOST and owner == CODE_HOST_UID):
                    files.append(path)
    processes = sandbox_processes()
    if ROOT_HOST:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.stat(f"/proc/{pid}").st_uid == CODE_HOST_UID:
                    processes.append(int(pid))
            except OSError:
                pass
    cgroup_root = memory_cgroup_root()
    cgroups = [name for name in os.listdir(cgroup_root) if name.startswith(CGROUP_PREFIX)] if cgroup_root else []
    return {"files": sorted(files), "processes": sorted(processes), "cgroups": cgroups}


@pytest.fixture(autouse=True)
def host_unchanged():
    """Nothing of the test is left on the host. A process killed at a limit dies asynchronously (the kernel runs its
    exit when it can: later on a loaded machine), so the trace gets 60 s to lose what the test added; a real
    leftover stays. What was there before the test (the end of an earlier test's call, still dying) may go."""
    before = host_trace()
    yield
    deadline = time.monotonic() + 60
    while (left := added_since(before, host_trace())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"left on the host: {left}"


def added_since(before: dict, after: dict) -> dict:
    """What `after` holds that `before` did not, per kind of trace."""
    added = {kind: sorted(set(after[kind]) - set(before[kind])) for kind in after}
    return {kind: items for kind, items in added.items() if items}


@pytest.fixture(scope="module")
def tool():
    return CodeInterpreterTool(dict(LIMITS), SCHEMA)


def interpreter_entries(top: str) -> list[str]:
    """What the sandbox shows in folder `top` of its root on the way to the interpreter's own folders (a virtualenv
    in a clone under /tmp shows up in the sandbox's /tmp)."""
    return sorted({path[len(top) + 1:].split("/")[0] for path in interpreter_paths() if path.startswith(top + "/")})


def attack(tool, code: str, raw_syscalls: bool = False) -> list[str]:
    """Run `code` in the sandbox (after SYSCALLS' `call` helper when `raw_syscalls`); its output lines. Every
    call must leave nothing behind."""
    code = (SYSCALLS if raw_syscalls else "") + textwrap.dedent(code)
    response, _, metrics = asyncio.run(tool.execute("attacker", {"code": code}))
    assert metrics["leftovers"] == 0
    return response.text.splitlines()


# Code that runs until the host wakes it with SIGCONT (blocked, then waited for: one sent before it is blocked is
# lost, which is why the host repeats it).
WAIT_FOR_THE_HOST = """
import signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCONT})
signal.sigwait({signal.SIGCONT})
"""


def code_processes() -> list[int]:
    """Host pids of the code the sandbox runs (`python -I -u main.py`)."""
    pids = []
    for pid in sandbox_processes():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[1:4] == [b"-I", b"-u", b"main.py"]:
                    pids.append(pid)
        except OSError:
            pass
    return pids


def observe_while_running(tool, look):
    """Run code in the sandbox that waits for the host: the host calls `look()` every 50 ms until it returns
    something, then wakes the code (SIGCONT, repeated until the call ends). What `look()` returned. The code cannot
    end before the host has looked, however loaded the machine: no sleep races the look."""
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            if not seen and (found := look()) is not None:
                seen.append(found)
            if seen:
                for pid in code_processes():
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            done.wait(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        attack(tool, WAIT_FOR_THE_HOST)
    finally:
        done.set()
        watcher.join()
    assert seen, "the host never saw what it looked for while the code ran"
    return seen[0]


# Raw syscalls for the attacks below (x86_64 numbers; the tests skip elsewhere).
SYSCALLS = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(number, *args):
    result = libc.syscall(number, *args)
    return result if result >= 0 else errno.errorcode[ctypes.get_errno()]
"""
x86_64 = pytest.mark.skipif(os.uname().machine != "x86_64", reason="raw syscall numbers are x86_64's")


# ------------------------------------------------------------------------------------------------ persistence

def test_a_setuid_copy_of_a_system_binary_cannot_be_made(tool):
    lines = attack(tool, f"""
        import os, shutil, stat
        shutil.copy('/usr/bin/env', '{MARK}-env')
        for mode in (0o4755, 0o2755, 0o6777):
            try:
                os.chmod('{MARK}-env', mode)
            except OSError as error:
                print(oct(mode), error.strerror)
        try:
            os.open('{MARK}-new', os.O_CREAT | os.O_WRONLY, 0o4755)
        except OSError as error:
            print('create setuid', error.strerror)
        print(oct(os.stat('{MARK}-env').st_mode & 0o7777))
        """)
    assert lines == ["0o4755 Operation not permitted", "0o2755 Operation not permitted",
                     "0o6777 Operation not permitted", "create setuid Operation not permitted", "0o755"]


def test_files_planted_in_one_call_are_gone_in_the_next_and_never_on_the_host(tool):
    plant = f"""
        import os
        for path in ('{MARK}', '/tmp/{MARK}', '/dev/shm/{MARK}'):
            open(path, 'w').write('x')
        print(sorted(os.listdir('.')), sorted(os.listdir('/tmp')), os.listdir('/dev/shm'))
        """
    in_tmp = sorted([MARK, "work", *interpreter_entries("/tmp")])
    assert attack(tool, plant) == [f"['{MARK}', 'main.py'] {in_tmp} ['{MARK}']"]
    assert attack(tool, f"import os\nprint([os.path.exists(p) for p in ('{MARK}', '/tmp/{MARK}', "
                        f"'/dev/shm/{MARK}')])") == ["[False, False, False]"]


def test_a_deep_tree_full_of_links_leaves_nothing(tool):
    """The old host-side cleanup raised RecursionError in a deep tree and left its files on the host."""
    lines = attack(tool, f"""
        import os
        for depth in range(1200):
            os.mkdir('d')
            os.symlink('/', 'root-link')
            os.symlink('/usr/bin/env', '{MARK}-link')
            os.chdir('d')
        open('{MARK}-deepest', 'w').write('x')
        print(depth + 1)
        """)
    assert lines == ["1200"]


def test_device_nodes_and_file_capabilities_cannot_be_made(tool):
    lines = attack(tool, f"""
        import os, stat
        for kind, name in ((stat.S_IFCHR, 'char'), (stat.S_IFBLK, 'block')):
            try:
                os.mknod('{MARK}-' + name, kind | 0o666, os.makedev(1, 3))
            except OSError as error:
                print(name, error.strerror)
        os.mkfifo('{MARK}-fifo')  # a FIFO is harmless and allowed
        try:
            os.setxattr('main.py', 'security.capability', b'\\x01\\x00\\x00\\x02' + bytes(16))
        except OSError as error:
            print('setxattr', error.strerror)
        """)
    assert lines == ["char Operation not permitted", "block Operation not permitted",
                     "setxattr Operation not permitted"]


def test_nothing_outside_its_tmpfs_is_writable(tool):
    lines = attack(tool, f"""
        import os
        targets = ['/{MARK}', '/etc/{MARK}', '/usr/{MARK}', '/usr/bin/env', '/proc/sys/kernel/hostname',
                   '/proc/sysrq-trigger', '/dev/{MARK}', os.path.join(os.path.dirname(os.__file__), '{MARK}')]
        for path in targets:
            try:
                open(path, 'a').close()
                print(path, 'WRITTEN')
            except OSError as error:
                print(error.strerror)
        """)
    # read-only mounts, and a root-owned file the code (nobody on a root host) may not even open for writing
    assert lines[:3] + lines[4:5] + lines[6:] == ["Read-only file system"] * 6
    assert lines[3] == ("Permission denied" if ROOT_HOST else "Read-only file system")
    assert lines[5] in ("Read-only file system", "No such file or directory")  # /proc/sysrq-trigger, where built


# ------------------------------------------------------------------------------------------------ disk

def test_fallocate_keep_size_cannot_reserve_past_the_limits(tool):
    lines = attack(tool, f"""
        FALLOC_FL_KEEP_SIZE = 1
        fd = os.open('{MARK}', os.O_CREAT | os.O_WRONLY)
        print(libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(10 << 30)),
              errno.errorcode[ctypes.get_errno()])
        reserved = 0
        for i in range(8):  # 8 x 15 MiB under the 16 MiB file limit: the 32 MiB tmpfs stops it
            fd = os.open(f'{MARK}{{i}}', os.O_CREAT | os.O_WRONLY)
            if libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(15 << 20)) != 0:
                print('stopped after', reserved >> 20, 'MiB:', errno.errorcode[ctypes.get_errno()])
                break
            reserved += 15 << 20
        """, raw_syscalls=True)
    assert lines == ["-1 EFBIG", "stopped after 30 MiB: ENOSPC"]


def test_many_files_add_up_to_the_disk_limit_not_past_it(tool):
    lines = attack(tool, f"""
        written = 0
        try:
            for i in range(64):  # 64 x 16 MiB = 1 GiB asked for
                with open(f'{MARK}{{i}}', 'wb') as f:
                    for _ in range(16):
                        f.write(b'x' * (1 << 20))
                        written += 1 << 20
        except OSError as error:
            print(error.strerror, written <= 32 << 20, written >= 24 << 20)
        """)
    assert lines == ["No space left on device True True"]


def test_inodes_run_out_before_the_host_notices(tool):
    lines = attack(tool, f"""
        count = 0
        try:
            while True:
                open(f'{MARK}{{count}}', 'w').close()
                count += 1
        except OSError as error:
            print(error.strerror, 3000 < count <= 4096)
        """)
    assert lines == ["No space left on device True"]


def test_dev_shm_and_tmp_share_one_budget(tool):
    lines = attack(tool, f"""
        with open('/dev/shm/{MARK}', 'wb') as f:
            f.write(b'x' * (15 << 20))
        with open('/tmp/{MARK}', 'wb') as f:
            f.write(b'x' * (15 << 20))
        try:
            with open('{MARK}', 'wb') as f:
                f.write(b'x' * (15 << 20))
        except OSError as error:
            print(error.strerror)
        """)
    assert lines == ["No space left on device"]


# ------------------------------------------------------------------------------------------------ sockets

@pytest.fixture
def host_listeners(tmp_path):
    """A host socket file, an abstract socket and a TCP port, each accepting; yields their addresses and how
    many connections each got."""
    path_listener = socket.socket(socket.AF_UNIX)
    path_listener.bind(str(tmp_path / "host.sock"))
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"\0{MARK}-{os.getpid()}"
    abstract.bind(abstract_name)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    reached = {"path": 0, "abstract": 0, "tcp": 0}
    stop = threading.Event()

    for listener in (path_listener, abstract, tcp):  # listening before the test runs: no race with the threads
        listener.listen()

    def accept(name, listener):
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                listener.accept()[0].close()
                reached[name] += 1
            except OSError:
                pass
    threads = [threading.Thread(target=accept, args=item, daemon=True)
               for item in (("path", path_listener), ("abstract", abstract), ("tcp", tcp))]
    for thread in threads:
        thread.start()
    yield {"path": str(tmp_path / "host.sock"), "abstract": abstract_name, "port": tcp.getsockname()[1]}, reached
    stop.set()
    for thread in threads:
        thread.join()
    for listener in (path_listener, abstract, tcp):
        listener.close()


CONNECT_TO_HOST = """
import socket
def attempt(name, make, address):
    try:
        sock = make()
        sock.settimeout(1)
        sock.connect(address)
        print(name, 'CONNECTED')
    except OSError as error:
        print(name, error.strerror)
attempt('path', lambda: socket.socket(socket.AF_UNIX), {path!r})
attempt('abstract', lambda: socket.socket(socket.AF_UNIX), {abstract!r})
attempt('tcp', socket.socket, ('127.0.0.1', {port}))
"""


def test_host_sockets_are_out_of_reach(tool, host_listeners):
    addresses, reached = host_listeners
    lines = attack(tool, CONNECT_TO_HOST.format(**addresses))
    assert lines == ["path Operation not permitted", "abstract Operation not permitted",
                     "tcp Network is unreachable"]
    assert reached == {"path": 0, "abstract": 0, "tcp": 0}


def test_with_allow_network_unix_sockets_stay_closed(host_listeners):
    """allow_network shares the host's network namespace (TCP is then the user's choice), but never its
    AF_UNIX sockets, abstract ones included, which live in that namespace."""
    addresses, reached = host_listeners
    tool = CodeInterpreterTool({**LIMITS, "allow_network": True}, SCHEMA)
    lines = attack(tool, CONNECT_TO_HOST.format(**addresses))
    assert lines[:2] == ["path Operation not permitted", "abstract Operation not permitted"]
    assert lines[2] == "tcp CONNECTED" and reached["path"] == reached["abstract"] == 0


def test_socketpair_sendto_cannot_address_a_host_socket(tool, host_listeners):
    """A datagram socketpair could sendto() any socket path; only stream pairs (asyncio's) are allowed, and a
    connected stream socket refuses a destination address."""
    addresses, _ = host_listeners
    lines = attack(tool, f"""
        import asyncio, socket
        try:
            socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        except OSError as error:
            print('dgram pair', error.strerror)
        a, b = socket.socketpair()
        try:
            a.sendto(b'x', {addresses['path']!r})
        except OSError as error:
            print('stream sendto', error.strerror)
        asyncio.run(asyncio.sleep(0))
        print('asyncio works')
        """)
    assert lines == ["dgram pair Function not implemented", "stream sendto Transport endpoint is already connected",
                     "asyncio works"]


@x86_64
def test_io_uring_cannot_be_set_up(tool):
    lines = attack(tool, """
        params = ctypes.create_string_buffer(120)
        print(call(425, 8, params), call(426, 0, 1, 0, 0), call(427, 0, 0, 0, 0))  # setup, enter, register
        """, raw_syscalls=True)
    assert lines == ["EPERM EPERM EPERM"]


def test_other_socket_families_are_refused(tool):
    lines = attack(tool, """
        import socket
        for family, kind, protocol in ((socket.AF_PACKET, socket.SOCK_RAW, 0), (socket.AF_NETLINK, socket.SOCK_RAW, 9),
                                       (socket.AF_INET, socket.SOCK_RAW, 1), (40, socket.SOCK_STREAM, 0)):
            try:
                socket.socket(family, kind, protocol)
                print(family, 'OPENED')
            except OSError as error:
                print(error.strerror)
        """)
    # AF_PACKET, netlink audit, vsock: not on the allowlist; a raw IP socket needs a capability it lacks
    assert lines == ["Function not implemented", "Function not implemented", "Operation not permitted",
                     "Function not implemented"]


# ------------------------------------------------------------------------------------------------ secrets

def test_host_homes_and_runtime_folders_are_not_in_its_root(tool):
    """Only the interpreter's own folders are bound in; the host's /root, /home, /work, /run, /var are not."""
    lines = attack(tool, """
        import os
        for top in ('/root', '/home', '/work', '/run', '/var', '/srv', '/mnt', '/opt', '/sys'):
            print(top, sorted(os.listdir(top)) if os.path.isdir(top) else None)
        print(sorted(os.listdir('/etc')))
        """)
    expected = []
    for top in ("/root", "/home", "/work", "/run", "/var", "/srv", "/mnt", "/opt", "/sys"):
        inside = interpreter_entries(top)
        expected.append(f"{top} {inside if inside else None}")
    assert lines[:-1] == expected
    assert lines[-1] == str(sorted(["alternatives", "group", "hosts", "ld.so.cache", "ld.so.conf", "ld.so.conf.d",
                                    "localtime", "nsswitch.conf", "passwd"]))


@pytest.mark.skipif(not ROOT_HOST, reason="a non-root host's code runs as that host user, who owns its files")
def test_root_only_files_stay_unreadable(tmp_path):
    """On a root host the code is `nobody` outside: a 0600 root file is closed to it even where it can see it."""
    tmp_path.chmod(0o755)
    (tmp_path / "secret").write_text("root only")
    (tmp_path / "secret").chmod(0o600)
    (tmp_path / "public").write_text("for everyone")
    (tmp_path / "public").chmod(0o644)
    tool = CodeInterpreterTool({**LIMITS, "read_only_paths": [str(tmp_path)]}, SCHEMA)
    lines = attack(tool, f"""
        import os
        print(open({str(tmp_path / 'public')!r}).read())
        try:
            open({str(tmp_path / 'secret')!r}).read()
        except OSError as error:
            print(error.strerror)
        try:
            open({str(tmp_path / 'public')!r}, 'a')
        except OSError as error:
            print(error.strerror)
        print(os.getuid(), os.getgid(), os.getgroups())
        """)
    assert lines == ["for everyone", "Permission denied", "Permission denied", "1000 1000 []"]


@pytest.mark.skipif(not ROOT_HOST, reason="the code's host uid is 65534 only on a root host")
def test_the_code_is_nobody_on_the_host_with_no_groups(tool):
    def code_process_status():
        for pid in sandbox_processes():
            try:
                if open(f"/proc/{pid}/cmdline", "rb").read().startswith(sys.executable.encode() + b"\0-I\0-u\0"):
                    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
                    return {key: status[key].split() for key in ("Uid", "Gid", "Groups", "CapEff", "CapBnd")}
            except OSError:
                pass
    status = observe_while_running(tool, code_process_status)
    assert status == {"Uid": ["65534"] * 4, "Gid": ["65534"] * 4, "Groups": [], "CapEff": ["0000000000000000"],
                      "CapBnd": ["0000000000000000"]}


@x86_64
def test_the_callers_keyring_is_out_of_reach(tool):
    """The host puts a secret in its session keyring; the code gets a fresh one and no keyring syscalls."""
    libc = ctypes.CDLL(None, use_errno=True)
    key = libc.syscall(248, b"user", f"{MARK}-key".encode(), b"s3cret", 6, -3)  # add_key to the session keyring
    if key < 0:
        pytest.skip(f"this host cannot add a key: {os.strerror(ctypes.get_errno())}")
    try:
        lines = attack(tool, f"""
            print(call(250, 0, -3, 0), call(250, 11, {key}, 0, 0))  # keyctl GET_KEYRING_ID, READ the host's key
            print(call(249, b'user', b'{MARK}-key', None, 0))        # request_key
            print(open('/proc/keys').read().count('{MARK}'))
            """, raw_syscalls=True)
    finally:
        libc.syscall(250, 3, key)  # KEYCTL_REVOKE
    assert lines == ["EPERM EPERM", "EPERM", "0"]


def test_the_environment_and_processes_of_the_host_are_invisible(tool):
    lines = attack(tool, """
        import os
        print(sorted(os.environ))
        pids = [pid for pid in os.listdir('/proc') if pid.isdigit()]
        print(pids, open('/proc/1/cmdline', 'rb').read().split(b'\\0')[2:3])
        print(os.uname().nodename)
        """)
    assert lines == ["['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']", "['1'] [b'-u']", "sandbox"]


# ------------------------------------------------------------------------------------------------ memory

@x86_64
def test_memfd_and_sysv_shared_memory_are_refused(tool):
    """Both hold memory outside RLIMIT_AS (a memfd went to 2 GiB against a 1 GiB limit)."""
    lines = attack(tool, """
        try:
            os.memfd_create('x')
        except OSError as error:
            print('memfd', error.strerror)
        print('shmget', call(29, 0, 1 << 30, 0o1000 | 0o600))
        """, raw_syscalls=True)
    assert lines == ["memfd Operation not permitted", "shmget EPERM"]


def test_large_anonymous_mappings_fail(tool):
    lines = attack(tool, """
        import mmap
        for flags in (mmap.MAP_PRIVATE, mmap.MAP_SHARED):
            try:
                mmap.mmap(-1, 2 << 30, flags=flags | mmap.MAP_ANONYMOUS)
            except OSError as error:
                print(error.strerror)
        try:
            bytearray(10 << 30)
        except MemoryError:
            print('MemoryError')
        """, raw_syscalls=True)
    assert lines == ["Cannot allocate memory", "Cannot allocate memory", "MemoryError"]


def test_memory_is_capped_by_a_cgroup_where_one_can_be_made(tool):
    root = memory_cgroup_root()
    if root is None:
        pytest.skip("no writable memory cgroup here: RLIMIT_AS and the tmpfs size bound the code alone")
    lines = attack(tool, """
        for line in open('/proc/self/cgroup'):
            print(line.strip())
        """)
    # the code sees its own cgroup namespace (rooted at the call's cgroup); the host side is checked by its limit
    assert "0::/" in lines
    limits = SandboxLimits(**{key: value for key, value in LIMITS.items() if key != "max_tool_response_length"})

    def joined_cgroup():
        for name in os.listdir(root):
            folder = os.path.join(root, name)
            limit_file = "memory.max" if os.path.exists(f"{folder}/memory.max") else "memory.limit_in_bytes"
            try:
                processes = len(open(os.path.join(folder, "cgroup.procs")).read().split())
                if name.startswith(CGROUP_PREFIX) and processes == 3:  # launcher, holder and code are in it
                    return int(open(os.path.join(folder, limit_file)).read()), processes
            except (OSError, ValueError):
                pass
    limit, _ = observe_while_running(tool, joined_cgroup)
    assert limit == limits.cgroup_bytes()


# ------------------------------------------------------------------------------------------------ privilege

@x86_64
def test_namespaces_cannot_be_made_or_joined(tool):
    lines = attack(tool, """
        CLONE_THREAD, CLONE_NEWUSER, CLONE_NEWNS = 0x10000, 0x10000000, 0x20000
        print(call(272, CLONE_NEWUSER), call(272, CLONE_NEWNS))         # unshare
        print(call(308, os.open('/proc/self/ns/user', os.O_RDONLY), 0))  # setns
        print(call(56, CLONE_THREAD | 0x100 | 0x800 | CLONE_NEWUSER, 0, 0, 0, 0))  # clone a thread into a new userns
        print(call(435, 0, 0))                                            # clone3: no filterable flags
        """, raw_syscalls=True)
    assert lines == ["EPERM EPERM", "EPERM", "EPERM", "ENOSYS"]


@x86_64
def test_the_mount_family_is_refused(tool):
    lines = attack(tool, """
        print(call(165, b'none', b'/tmp', b'tmpfs', 0, None), call(166, b'/tmp', 2))  # mount, umount2
        print(call(155, b'/tmp', b'/tmp/work'), call(161, b'/tmp'))                  # pivot_root, chroot
        print(call(428, -100, b'/', 1), call(430, b'tmpfs', 0), call(442, -100, b'/', 0x8000, None, 0))
        """, raw_syscalls=True)  # open_tree, fsopen, mount_setattr
    assert lines == ["EPERM EPERM", "EPERM EPERM", "EPERM EPERM EPERM"]


@x86_64
def test_tracing_bpf_and_perf_are_refused(tool):
    lines = attack(tool, """
        print(call(101, 0, 0, 0, 0), call(310, 1, 0, 1, 0, 0))  # ptrace(TRACEME), process_vm_readv
        print(call(321, 0, 0, 0), call(298, ctypes.create_string_buffer(128), 0, -1, -1, 0))  # bpf, perf_event_open
        print(call(323, 0), call(304, 0, 0, 0))  # userfaultfd, open_by_handle_at
        """, raw_syscalls=True)
    assert lines == ["EPERM EPERM", "EPERM EPERM", "EPERM EPERM"]


def test_no_identity_change_and_no_capabilities(tool):
    lines = attack(tool, """
        import os
        for change in (lambda: os.setuid(0), lambda: os.setresuid(0, 0, 0), lambda: os.setgroups([0])):
            try:
                change()
                print('CHANGED')
            except OSError as error:
                print(error.strerror)
        status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
        print(*(status[key].strip() for key in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp')))
        """)
    assert lines == ["Operation not permitted"] * 3 + [" ".join(["0000000000000000"] * 4 + ["1", "2"])]


@x86_64
def test_another_abi_is_killed(tool):
    """x32 syscalls share x86_64's audit architecture; the filter must not let them past its rules."""
    response, _, metrics = asyncio.run(tool.execute("attacker", {"code": SYSCALLS + "call(0x40000000 + 39)"}))
    assert metrics["exit_code"] == 128 + 31 and response.text.endswith("[killed by SIGSYS]")


def test_kill_minus_one_reaches_no_host_process(tool):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        lines = attack(tool, "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as error:\n"
                             "    print(error.strerror)")
        assert lines == ["No such process"] and sleeper.poll() is None  # it is alone in its PID namespace
    finally:
        sleeper.kill()
        sleeper.wait()


def test_new_processes_are_refused(tool):
    lines = attack(tool, """
        import os, subprocess
        for start in (os.fork, lambda: subprocess.run(['true']), lambda: os.posix_spawn('/usr/bin/true', ['true'], {})):
            try:
                start()
                print('STARTED')
            except OSError as error:
                print(error.strerror)
        """)
    assert lines == ["Operation not permitted"] * 3


# ------------------------------------------------------------------------------------------------ downgrade

def test_unsafe_mode_cleans_a_hostile_tree_without_following_links(tmp_path, caplog):
    """unsafe_no_isolation works in a host folder; its cleanup walks a deep tree full of links to the outside
    without recursion and without touching what they point to, and every call warns."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    # about 2 CPU seconds on a host disk (deeper than rmtree's recursion could go), so a CPU limit with room, and a
    # wall-clock limit that 30 CPU seconds on a loaded machine could not reach
    tool = CodeInterpreterTool({**LIMITS, "unsafe_no_isolation": True, "cpu_time_s": 30, "timeout_s": 600}, SCHEMA)
    lines = attack(tool, f"""
        import os
        for depth in range(1200):
            os.mkdir('d')
            os.symlink({str(outside)!r}, '{MARK}-dir-link')
            os.symlink({str(outside / 'keep')!r}, '{MARK}-file-link')
            os.chdir('d')
        print(depth + 1)
        """)
    assert lines == ["1200"] and (outside / "keep").read_text() == "keep" and os.listdir(outside) == ["keep"]
    assert sum("unsafe_no_isolation is set, so this call runs" in record.message for record in caplog.records) == 1


def test_remove_tree_counts_what_it_cannot_remove(tmp_path):
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "file").write_text("x")
    (tree / "link").symlink_to(tmp_path)
    (tmp_path / "other").write_text("kept")
    assert remove_tree(str(tree)) == 0 and not tree.exists() and (tmp_path / "other").read_text() == "kept"
    assert remove_tree(str(tmp_path / "missing")) == 0
    (tmp_path / "file-not-folder").write_text("x")
    assert remove_tree(str(tmp_path / "file-not-folder")) == 1  # not a folder: left, counted, no exception


def test_a_python_under_tmp_runs_inside():
    """The interpreter's own folders are bound into the root wherever they are, /tmp included (a CI clone under
    /tmp used to find its Python hidden by the sandbox's tmpfs)."""
    venv = tempfile.mkdtemp(prefix=f"{MARK}-venv-", dir="/tmp")
    os.chmod(venv, 0o755)  # mkdtemp's 0700 would close it to the code's unprivileged user, as any such folder
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True)
        script = ("import asyncio, importlib.util, sys; "  # sandbox.py alone: the venv has no hybridrl dependencies
                  "spec = importlib.util.spec_from_file_location('sandbox', sys.argv[1]); "
                  "sandbox = sys.modules['sandbox'] = importlib.util.module_from_spec(spec); "
                  "spec.loader.exec_module(sandbox); "
                  "limits = sandbox.SandboxLimits(timeout_s=60); "
                  "r = asyncio.run(sandbox.run_python('import sys; print(sys.prefix)', limits)); "
                  "print(r.output.strip(), r.exit_code)")
        result = subprocess.run([os.path.join(venv, "bin", "python"), "-c", script, sandbox_module.__file__],
                                capture_output=True, text=True, timeout=300)
        assert result.stdout.strip() == f"{venv} 0", result.stderr
    finally:
        shutil.rmtree(venv)
