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
  within seconds. `stop()` does the same for a driver that ends normally, then SIGKILLs what is left.
- It runs in a session of its own, so Ctrl-C reaches the driver alone, which can then stop cleanly.
- Its files live in its own temp dir (<tmp>/hybridrl-ray), so a plain `ray.init()` elsewhere on the machine does not
  find it and join it (`ray start` records its address for that in its temp dir).
- Heads on one machine start one at a time (a lock file in that temp dir). Two started together both saw Ray's fixed
  dashboard port 8265 free; the one whose dashboard then lost the port waited 60 s for it before its node came up
  (measured 63 s against 6 s). Started in turn, the second sees the port taken, logs it and is up in seconds,
  without a dashboard of its own. Ports stay Ray's choice: giving each head free ports, or no dashboard, stalled the
  test suite's own Ray (3 of 4 full runs, and 1 of 1 subset), cause not found (commits 6de7671 to 0615bb7).
- It uses token authentication with a token made for this run (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), as a local
  `ray.init()` cluster does; the environment's own RAY_AUTH_MODE / RAY_AUTH_TOKEN win.
"""
from __future__ import annotations

import ctypes
import fcntl
import ipaddress
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
HEAD_START_TIMEOUT_S = 120
HEAD_STARTED_LINE = "Ray runtime started."  # what `ray start` prints once the node is up
HEAD_STOP_TIMEOUT_S = 30
HEAD_START_LOCK = "head_start.lock"
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


class LocalRayCluster:
    """`start()` returns the address to `ray.init`; `stop()` ends every process of the cluster."""

    def __init__(self, num_cpus: Optional[int], node_ip_address: Optional[str]):
        self.num_cpus = num_cpus
        self.host = "127.0.0.1" if node_ip_address is None else node_ip_address
        self.temp_dir = os.path.join(tempfile.gettempdir(), "hybridrl-ray")
        self.log_path = os.path.join(self.temp_dir, f"head_{os.getpid()}.log")
        self._head: Optional[subprocess.Popen] = None

    def start(self) -> str:
        os.makedirs(self.temp_dir, exist_ok=True)
        with open(os.path.join(self.temp_dir, HEAD_START_LOCK), "w") as lock:
            _wait_for_lock(lock)
            port = _free_port(self.host)
            self._start_head(port)
            self._wait_until_started()
        return f"{self.host}:{port}"

    def stop(self) -> None:
        """SIGTERM the head (it stops Ray's processes), wait for it, then SIGKILL whatever of the cluster is left."""
        if self._head is None:
            return
        try:
            cluster = psutil.Process(self._head.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            cluster = []
        self._head.terminate()
        try:
            self._head.wait(timeout=HEAD_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._head.kill()
            self._head.wait()
        for process in cluster:
            try:
                process.kill()  # psutil checks the pid still belongs to that process
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(cluster, timeout=HEAD_STOP_TIMEOUT_S)
        self._head = None

    def _start_head(self, port: int) -> None:
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}",
                   f"--temp-dir={self.temp_dir}", "--disable-usage-stats", f"--node-ip-address={self.host}"]
        if self.num_cpus is not None:
            command.append(f"--num-cpus={self.num_cpus}")
        # No drain period on SIGTERM: nothing here serves traffic, and the head should go at once. Unbuffered: the
        # driver reads the head's output to know when it is up.
        env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self._head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=_die_with_parent)

    def _wait_until_started(self) -> None:
        """Until `ray start` reports the node started: its GCS accepts connections before the raylet has
        registered, and a driver connecting then finds no node."""
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._head.poll() is not None:
                raise RuntimeError(f"the local Ray head exited with code {self._head.returncode} while starting; "
                                   f"its output ({self.log_path}):\n{_tail(self.log_path)}")
            with open(self.log_path, errors="replace") as log:
                if HEAD_STARTED_LINE in log.read():
                    return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the local Ray head did not start within {HEAD_START_TIMEOUT_S} s; its output "
                           f"({self.log_path}):\n{_tail(self.log_path)}")


def _wait_for_lock(lock) -> None:
    """Take the head-start lock; say so when another run's head is starting (it holds the lock up to
    HEAD_START_TIMEOUT_S). The kernel releases it when its holder dies."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("local Ray cluster: waiting for another run's Ray head on this machine to finish starting", flush=True)
        fcntl.flock(lock, fcntl.LOCK_EX)


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when the driver dies (Linux; elsewhere a no-op)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
