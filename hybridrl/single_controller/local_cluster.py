"""The Ray cluster of a single-machine run: started by the driver, on loopback, and gone with the driver.

`ray.init()` without an address starts Ray's processes as children of the driver, in its process group, listening
on every interface; a SIGKILLed driver leaves Ray's agents alive for about a minute (they try to report the raylet's
death to the GCS that died with it), and Ctrl-C in a terminal hits Ray's processes too. `LocalRayCluster` runs Ray's
own `ray start --head --block` instead, and the driver connects to it:

- It listens on 127.0.0.1 only, unless ``ray_init.node_ip_address`` names an IP of this machine (Ray then listens on
  the network, and other machines can join). Ray takes a loopback node address only in its single-machine mode,
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (its default on macOS and Windows), which it reads when it is imported:
  `prepare_driver_process` sets it before the driver's first `import ray`, and every Ray process inherits it.
- It goes with the driver however the driver ends: the kernel sends the head SIGTERM when the driver dies, even by
  SIGKILL (Linux prctl PR_SET_PDEATHSIG), and the head stops raylet and GCS gracefully, so workers and agents follow
  within seconds. `stop()` does the same for a driver that ends normally, then SIGKILLs what is left of the head's
  session (a head stopped while starting leaves Ray's processes to it).
- It runs in a session of its own, so Ctrl-C reaches the driver alone, which can then stop cleanly.
- Its files live in its own temp dir (<tmp>/hybridrl-ray), so a plain `ray.init()` elsewhere on the machine does not
  find it and join it (`ray start` records its address for that in its temp dir).
- Heads on one machine start side by side. Every port a head listens on with a fixed Ray default (GCS 6379, dashboard
  8265, dashboard agent 52365, client server 10001, metrics 44217 and 44227) is a free one picked at each start.
  With the defaults, two heads started together both saw 8265 free and the one whose dashboard lost it waited 60 s
  (63 s against 6 s); heads then took turns under a lock, the second up in about twice a lone start. Free ports once
  seemed to stall the test suite's own Ray (commits 6de7671 to 0615bb7): that was the test process forking while its
  Ray ran, which tests/conftest.py now fails. Measured on 2 cores beside other test suites (load average 7 to 34),
  6 rounds: two heads started together were both up within 0.96x to 1.86x a lone start (19 to 51 s), 5 rounds within
  1.5x, and all 18 starts came up; the code with the lock, which started a head once, lost 6 of 18 to Ray's 30 s
  wait (next point). On 16 idle cores two heads were up within 0.91x to 1.40x a lone start in 8 of 8 rounds; on 2
  cores a lone start alone keeps 63-68 % of both busy, so two there take 1.3x to 1.9x
  (benchmarks/side_by_side_start.py).
- Ray's dashboard is off unless ``ray_init.include_dashboard`` (then on a free port of 127.0.0.1, printed): without
  its modules a start takes about a quarter less CPU (10 against 13 CPU-seconds, 2 cores), which two heads share.
- A loaded machine starts Ray slowly, and Ray gives its raylet a fixed 30 s to register ("The current node timed out
  during startup"): the driver then starts the head again, until ``ray_init.start_timeout_s``, and fails with the
  machine's load average against its CPUs.
- It uses token authentication with a token made for this run (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), as a local
  `ray.init()` cluster does; the environment's own RAY_AUTH_MODE / RAY_AUTH_TOKEN win.
- Arguments and results up to 1 MiB travel inside the call (Ray's max_direct_call_object_size, 100 KiB by default),
  not through the object store, whose put and get each wait on the raylet: a 2-rank call with 150 KiB a rank took
  17.7-17.9 ms against 8.1-8.2 ms inline, 400 KiB 16.4-17.9 against 10.9-12.5 ms (2 cores at load 30, issue 58). The
  toy task's batches (60-400 KiB a rank) go inline; a real batch's chunks (megabytes) still go through the store.
"""
from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import psutil

SINGLE_MACHINE_MODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
HEAD_STARTED_LINE = "Ray runtime started."  # what `ray start` prints once the node is up
HEAD_STOP_TIMEOUT_S = 30
# The ports a head listens on with a fixed Ray default, each given a free one at every start: `ray start` flags (GCS
# 6379, dashboard 8265, dashboard agent 52365, client server 10001) and the environment variables of the metrics
# servers of Ray's autoscaler monitor (44217) and dashboard (44227). Ray picks the node's other ports at random.
HEAD_PORT_FLAGS = ("port", "dashboard-port", "dashboard-agent-listen-port", "ray-client-server-port")
HEAD_PORT_ENV_VARS = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")
DASHBOARD_HOST = "127.0.0.1"  # also for a cluster on the network: the dashboard answers this machine alone
# Ray's words, and its fixed wait, when the raylet has not registered in time (ray/_private/node.py)
RAY_NODE_TIMED_OUT = "The current node timed out during startup."
RAY_NODE_WAIT_S = 30
SYSTEM_CONFIG = {"max_direct_call_object_size": 1 << 20}  # bytes an argument or result may carry inside a call
_PR_SET_PDEATHSIG = 1


def is_loopback(node_ip_address: Optional[str]) -> bool:
    """True for the default (None) and for addresses of the loopback interface."""
    if node_ip_address is None or node_ip_address == "localhost":
        return True
    return ipaddress.ip_address(node_ip_address).is_loopback


def prepare_driver_process(node_ip_address: Optional[str]) -> None:
    """Set, in this process's environment, what the driver and the cluster it starts need: token authentication
    and, for a loopback cluster, Ray's single-machine mode. Call it before ray is imported."""
    loopback = is_loopback(node_ip_address)
    ray_constants = sys.modules.get("ray._private.ray_constants")
    if loopback and ray_constants is not None and ray_constants.ENABLE_RAY_CLUSTER:
        raise RuntimeError("ray was imported before the driver could put it in its single-machine mode, so Ray "
                           "would listen on every interface: import ray after run_ppo starts, or set "
                           "ray_init.node_ip_address to an IP of this machine")
    if loopback:
        os.environ[SINGLE_MACHINE_MODE_ENV] = "0"
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] == "token" and "RAY_AUTH_TOKEN" not in os.environ \
            and "RAY_AUTH_TOKEN_PATH" not in os.environ:
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


class ClusterStartError(RuntimeError):
    """The local cluster did not start: the message says why (the head's own output included)."""


# How long a start may take when ray_init.start_timeout_s is null: a lone start takes seconds, one under heavy load
# (a test suite and another run beside it) has taken over a minute.
DEFAULT_START_TIMEOUT_S = 120.0


class LocalRayCluster:
    """`start()` returns the address to `ray.init`; `stop()` ends every process of the cluster."""

    def __init__(self, num_cpus: Optional[int], node_ip_address: Optional[str], *, include_dashboard: bool,
                 start_timeout_s: Optional[float]):
        self.num_cpus = num_cpus
        self.host = "127.0.0.1" if node_ip_address is None else node_ip_address
        self.include_dashboard = include_dashboard
        self.start_timeout_s = DEFAULT_START_TIMEOUT_S if start_timeout_s is None else start_timeout_s
        self.temp_dir = os.path.join(tempfile.gettempdir(), "hybridrl-ray")
        self.log_path = os.path.join(self.temp_dir, f"head_{os.getpid()}.log")
        self._head: Optional[subprocess.Popen] = None

    def start(self) -> str:
        """Start the head, and start it again each time Ray gives up waiting for its node (a loaded machine), until
        `start_timeout_s` has passed; prints the address and how long it took."""
        os.makedirs(self.temp_dir, exist_ok=True)
        began = time.monotonic()
        deadline = began + self.start_timeout_s
        ray_gave_up: list[str] = []  # Ray's own message, once per attempt it abandoned
        while True:
            ports = dict(zip(HEAD_PORT_FLAGS + HEAD_PORT_ENV_VARS,
                             _free_ports(self.host, len(HEAD_PORT_FLAGS) + len(HEAD_PORT_ENV_VARS))))
            self._start_head(ports)
            if self._wait_until_started(deadline, ray_gave_up):
                break
            print(f"local Ray cluster: {ray_gave_up[-1]} Starting it again (ray_init.start_timeout_s="
                  f"{self.start_timeout_s:g} s, {time.monotonic() - began:.0f} s spent)", flush=True)
        address = f"{self.host}:{ports['port']}"
        print(f"local Ray cluster up in {time.monotonic() - began:.1f} s at {address}", flush=True)
        if self.include_dashboard:
            print(f"local Ray cluster: dashboard at http://{DASHBOARD_HOST}:{ports['dashboard-port']}", flush=True)
        return address

    def stop(self) -> None:
        """SIGTERM the head (it stops Ray's processes), wait for it, then SIGKILL whatever of its session is left:
        a head stopped while it starts leaves Ray's processes behind."""
        if self._head is None:
            return
        self._head.terminate()
        try:
            self._head.wait(timeout=HEAD_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._head.kill()
            self._head.wait()
        left = _processes_in_session(self._head.pid)
        for process in left:
            try:
                process.kill()  # psutil checks the pid still belongs to that process
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=HEAD_STOP_TIMEOUT_S)
        self._head = None

    def _start_head(self, ports: dict[str, int]) -> None:
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                   f"--temp-dir={self.temp_dir}", "--disable-usage-stats", f"--node-ip-address={self.host}",
                   f"--include-dashboard={str(self.include_dashboard).lower()}", f"--dashboard-host={DASHBOARD_HOST}",
                   f"--system-config={json.dumps(SYSTEM_CONFIG)}",
                   *(f"--{flag}={ports[flag]}" for flag in HEAD_PORT_FLAGS)]
        if self.num_cpus is not None:
            command.append(f"--num-cpus={self.num_cpus}")
        # No drain period on SIGTERM: nothing here serves traffic, and the head should go at once. Unbuffered: the
        # driver reads the head's output to know when it is up.
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "PYTHONUNBUFFERED": "1",
               **{name: str(ports[name]) for name in HEAD_PORT_ENV_VARS}}
        with open(self.log_path, "w") as log:
            self._head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent)

    def _wait_until_started(self, deadline: float, ray_gave_up: list[str]) -> bool:
        """True once `ray start` reports the node started (its GCS accepts connections before the raylet has
        registered, and a driver connecting then finds no node); False when Ray gave up on its node (its message
        appended to `ray_gave_up`). Raises ClusterStartError when the head fails otherwise, or at the deadline."""
        while time.monotonic() < deadline:
            exit_code = self._head.poll()
            if exit_code is None and HEAD_STARTED_LINE in _read(self.log_path):
                return True
            if exit_code is not None:
                output = _read(self.log_path)
                self.stop()  # what Ray left of its session
                if RAY_NODE_TIMED_OUT not in output:
                    raise ClusterStartError(f"the local Ray head exited with code {exit_code} while starting; its "
                                            f"output ({self.log_path}):\n{_tail(self.log_path)}")
                ray_gave_up.append(_line_with(output, RAY_NODE_TIMED_OUT))
                return False
            time.sleep(0.2)
        self.stop()
        raise ClusterStartError(self._too_slow_message(ray_gave_up))

    def _too_slow_message(self, ray_gave_up: list[str]) -> str:
        """Why the cluster did not start in time, and what to change: the machine's load against its CPUs, Ray's own
        word, the head's output."""
        gave_up = (f"; Ray gave up on its node {len(ray_gave_up)} time(s) (it waits {RAY_NODE_WAIT_S} s for the "
                   f"raylet to register): {ray_gave_up[-1]!r}" if ray_gave_up else "")
        return (f"the local Ray cluster did not start within ray_init.start_timeout_s={self.start_timeout_s:g} s "
                f"(1-min load average {os.getloadavg()[0]:.2f} on {_cpu_count()} CPUs{gave_up}). A loaded machine "
                f"starts Ray slowly: raise ray_init.start_timeout_s, or lower the load. The head's last output "
                f"({self.log_path}):\n{_tail(self.log_path)}")


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when the driver dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _free_ports(host: str, count: int) -> list[int]:
    """`count` distinct ports free on `host`: each socket stays bound until all are picked."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _processes_in_session(session_id: int) -> list[psutil.Process]:
    """Every process of a session: Ray's processes and workers stay in the head's, even once the head is gone."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session_id:
                found.append(process)
        except (ProcessLookupError, PermissionError):
            pass
    return found


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _line_with(text: str, part: str) -> str:
    return next(line.strip() for line in text.splitlines() if part in line)


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
