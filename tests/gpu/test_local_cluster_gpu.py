"""A local cluster on 2 GPUs stays on loopback, NCCL included (the CPU side: tests/test_local_cluster.py).

Run on a GPU machine with 2 GPUs from the repository root:  python -m pytest tests/gpu/test_local_cluster_gpu.py -q
The driver side runs in a subprocess: Ray must be put in its single-machine mode before it is imported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = '''
import ipaddress, json, os
import psutil
from hybridrl.single_controller.local_cluster import LocalRayCluster, prepare_driver_process

prepare_driver_process(None)
import ray
import torch
import torch.distributed as dist

from hybridrl.single_controller import Dispatch, Worker, register
from hybridrl.single_controller.heartbeat import WorkerWatch
from hybridrl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from hybridrl.utils.distributed import init_process_group_once


class NcclWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce(self):
        init_process_group_once()
        value = torch.full((1,), float(self.rank + 1), device="cuda")
        dist.all_reduce(value)
        return dist.get_backend(), value.item(), os.environ.get("NCCL_SOCKET_IFNAME")


cluster = LocalRayCluster(num_cpus=None, node_ip_address=None, include_dashboard=False, start_timeout_s=120)
address = cluster.start()
try:
    ray.init(address=address)
    group = RayWorkerGroup(RayResourcePool([2], use_gpu=True), RayClassWithInitArgs(NcclWorker),
                           watch=WorkerWatch(start_timeout=120, heartbeat_interval=2, heartbeat_timeout=30,
                                             call_timeout=300))
    results = group.all_reduce()
    processes = [psutil.Process()] + psutil.Process().children(recursive=True)
    pids = {p.pid: p.name() for p in processes}
    listening = sorted({(pids[c.pid], c.laddr.ip) for c in psutil.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN and c.pid in pids})
    print("RESULT " + json.dumps({"results": results, "listening": listening}))
finally:
    ray.shutdown()
    cluster.stop()
'''


def test_nccl_all_reduce_on_a_loopback_cluster_listens_on_loopback_only():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert report["results"] == [["nccl", 3.0, "lo"], ["nccl", 3.0, "lo"]]
    names = {name for name, _ in report["listening"]}
    assert "gcs_server" in names and any(name.startswith("ray::NcclWorker") for name in names), names
    exposed = [(name, ip) for name, ip in report["listening"]
               if not (ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1"))]
    assert not exposed, exposed
