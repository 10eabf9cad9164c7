"""A worker group spread over a real 2-node Ray cluster on this machine: `ray start --head` plus
`ray start --address`, one CPU each, so RayResourcePool([1, 1]) must put one rank on each node.

The cluster has its own temp dir and ports, so any other Ray on the machine (other tests, other
users) is untouched and `ray.init()` elsewhere cannot stumble on it. The driver runs in a
subprocess (this file run as a script), so this pytest process's own Ray is untouched too. Each
`ray start --block` runs in a session of its own; stopping it stops exactly what it started.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_IP = "127.0.0.1"
# hang guards a loaded 2-core machine cannot reach (a Ray head took 29 s to start at load 10-15)
START_TIMEOUT_S = 240
DRIVER_TIMEOUT_S = 300


def test_all_reduce_over_a_two_node_cluster():
    temp_dir = tempfile.mkdtemp(prefix="hrl_", dir="/tmp")  # short: Ray's unix socket paths live under it
    gcs_port, *head_ports = _free_ports(8)
    worker_ports = _free_ports(6)
    address = f"{NODE_IP}:{gcs_port}"
    nodes = []
    try:
        nodes.append(_start_node(["--head", f"--port={gcs_port}", "--include-dashboard=false",
                                  f"--ray-client-server-port={head_ports.pop()}", *_node_port_flags(head_ports)],
                                 temp_dir, "head"))
        nodes.append(_start_node([f"--address={address}", *_node_port_flags(worker_ports)], temp_dir, "worker"))
        driver = subprocess.run([sys.executable, __file__, address], cwd=REPO_ROOT, env=_ray_env(),
                                capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
        assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
        results = json.loads(driver.stdout.strip().splitlines()[-1])
        assert [(result["rank"], result["reduced"]) for result in results] == [(0, 3.0), (1, 3.0)]
        assert results[0]["node_id"] != results[1]["node_id"]
        assert results[0]["alive_nodes"] == 2
    finally:
        for node in reversed(nodes):
            _stop_node(node)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:  # all held open at once, so the ports are distinct
        sock.bind((NODE_IP, 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def _node_port_flags(ports: list[int]) -> list[str]:
    names = ["node-manager-port", "object-manager-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port"]
    return [f"--{name}={port}" for name, port in zip(names, ports, strict=True)]


def _ray_env() -> dict:
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "disabled"  # a loopback-only test cluster; every process of it must agree on the mode
    return env


def _start_node(flags: list[str], temp_dir: str, name: str) -> subprocess.Popen:
    log_path = Path(temp_dir) / f"{name}.log"
    with open(log_path, "w") as log:
        node = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--num-cpus=1",
                                 f"--node-ip-address={NODE_IP}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
                                 *flags], stdout=log, stderr=subprocess.STDOUT, env=_ray_env(),
                                start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Ray runtime started" not in log_path.read_text():
        if node.poll() is not None or time.monotonic() > deadline:
            _stop_node(node)
            raise RuntimeError(f"ray start ({name}) did not come up:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return node


def _stop_node(node: subprocess.Popen) -> None:
    node.terminate()  # `ray start --block` stops the processes of its node on SIGTERM
    try:
        node.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:  # anything left is in the session created for this node: nothing else is
        os.killpg(node.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    node.wait()


def _run_driver(address: str) -> None:
    """The controller: joins the cluster, spreads a 2-rank group over the nodes, prints the results as JSON."""
    import ray
    import torch
    import torch.distributed as dist

    from hybridrl.single_controller import Dispatch, Worker, register
    from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from hybridrl.utils.distributed import init_process_group_once

    class ReduceWorker(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def all_reduce(self) -> dict:
            init_process_group_once()
            value = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(value)
            return {"rank": self.rank, "reduced": value.item(), "node_id": ray.get_runtime_context().get_node_id()}

    ray.init(address=address, _node_ip_address=NODE_IP, log_to_driver=False)
    pool = RayResourcePool([1, 1], use_gpu=False)
    results = RayWorkerGroup(pool, RayClassWithInitArgs(ReduceWorker)).all_reduce()
    alive_nodes = sum(node["Alive"] for node in ray.nodes())
    pool.remove()
    ray.shutdown()
    print(json.dumps([dict(result, alive_nodes=alive_nodes) for result in results]))


if __name__ == "__main__":
    _run_driver(sys.argv[1])
