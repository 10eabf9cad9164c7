"""What a local run listens on, piece by piece (the whole run: test_driver_lifecycle.py), and two local runs on one
machine."""
import json
import os
import subprocess
import sys
from unittest import mock

import pytest

from hybridrl.single_controller.local_cluster import SINGLE_MACHINE_MODE_ENV, is_loopback, prepare_driver_process

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One rank joins a process group the way every worker does, then prints where its process listens.
ONE_RANK = '''
import json, os, socket, psutil
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
from hybridrl.utils.distributed import init_process_group_once
init_process_group_once()
listening = sorted({(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("tcp")
                    if c.status == psutil.CONN_LISTEN})
print(json.dumps({"port": port, "listening": listening, "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}))
'''

# A driver as main_ppo starts one: its own local cluster, one task on it. Prints the answer and when its head start
# took the head-start lock and when the head was up (time.monotonic: CLOCK_MONOTONIC, one clock for every process of
# the machine), and the seconds its start took in all.
ONE_DRIVER = '''
import json, time
from hybridrl.single_controller import local_cluster
from hybridrl.single_controller.local_cluster import LocalRayCluster, prepare_driver_process
window = {}
take_lock, wait_until_started = local_cluster._wait_for_lock, LocalRayCluster._wait_until_started
def timed_lock(lock):
    take_lock(lock)
    window["locked"] = time.monotonic()
def timed_start(cluster):
    wait_until_started(cluster)
    window["up"] = time.monotonic()
local_cluster._wait_for_lock, LocalRayCluster._wait_until_started = timed_lock, timed_start
prepare_driver_process(None)
cluster = LocalRayCluster(num_cpus=1, node_ip_address=None)
began = time.monotonic()
address = cluster.start()
start_s = time.monotonic() - began
import ray
ray.init(address=address)
answer = ray.get(ray.remote(lambda: 6 * 7).remote())
ray.shutdown()
cluster.stop()
print(json.dumps({"answer": answer, "start_s": start_s, **window}))
'''


def test_the_rendezvous_store_and_gloo_stay_on_loopback():
    """torch's env:// store listened on every interface of rank 0's machine, whatever MASTER_ADDR said."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("GLOO_SOCKET_IFNAME", None)
    result = subprocess.run([sys.executable, "-c", ONE_RANK], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert ["127.0.0.1", report["port"]] in report["listening"]  # the store, on MASTER_ADDR
    assert all(is_loopback(ip) for ip, _ in report["listening"]), report["listening"]
    assert report["gloo_ifname"] == "lo"


def test_loopback_addresses():
    assert is_loopback(None) and is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.0.0.7")


@pytest.fixture(autouse=True)
def restored_environment():
    """prepare_driver_process writes os.environ (its job in a driver); give this test process its own back, or the
    run token and single-machine mode would reach every later test's subprocesses (which then cannot join the
    session's Ray)."""
    with mock.patch.dict(os.environ):
        yield


def test_the_driver_refuses_a_loopback_cluster_once_ray_is_imported(monkeypatch):
    """Ray reads its single-machine mode when imported; a driver that imported it first would listen everywhere."""
    import ray  # noqa: F401 — as any test process has

    monkeypatch.delenv(SINGLE_MACHINE_MODE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="ray was imported before the driver could put it in its single-machine"):
        prepare_driver_process(None)
    assert SINGLE_MACHINE_MODE_ENV not in os.environ


def test_a_cluster_on_a_network_address_gets_a_run_token_and_keeps_the_users(monkeypatch):
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", SINGLE_MACHINE_MODE_ENV):
        monkeypatch.delenv(name, raising=False)
    prepare_driver_process("10.0.0.7")
    assert os.environ["RAY_AUTH_MODE"] == "token" and len(os.environ["RAY_AUTH_TOKEN"]) == 64
    assert SINGLE_MACHINE_MODE_ENV not in os.environ  # Ray keeps its network mode for a network address
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    prepare_driver_process("10.0.0.7")
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ


@pytest.mark.parametrize("exported, expected", [(None, "0"), ("1", "1")])
def test_ray_workers_run_nccl_with_sglangs_buffer_kind_unless_the_user_says_otherwise(exported, expected):
    """SGLang's engine processes set NCCL_CUMEM_ENABLE=0; a trainer rank sharing an NCCL group with them (the
    disaggregated weight-update group) must match, or the first broadcast fails with 'invalid argument' (2 H200s,
    2026-11-27). main_ppo gives every Ray worker that value; one the user exported wins."""
    env = {key: value for key, value in os.environ.items() if key != "NCCL_CUMEM_ENABLE"}
    if exported is not None:
        env["NCCL_CUMEM_ENABLE"] = exported
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", "from hybridrl.main_ppo import WORKER_ENV_VARS as v; "
                          "print(v['NCCL_CUMEM_ENABLE'])"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected


@pytest.mark.slow
def test_two_runs_started_together_both_have_their_cluster_within_seconds():
    """Two heads started at once both found Ray's fixed dashboard port free, and the one whose dashboard lost it
    waited 60 s before its node came up: 63 s against 6 s here before heads took turns (about 4 s and 8 s idle).
    Checked as the turns themselves, not as seconds a loaded machine could stretch past any bound: the second head
    took the lock only once the first was up, so it found the port taken (and started without a dashboard)."""
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    drivers = [subprocess.Popen([sys.executable, "-c", ONE_DRIVER], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    reports = []
    for driver in drivers:
        out, err = driver.communicate(timeout=600)  # a hang guard: two Ray heads in turn on a loaded machine
        assert driver.returncode == 0, err[-3000:]
        reports.append(json.loads(out.splitlines()[-1]))
    assert [report["answer"] for report in reports] == [42, 42]
    first, second = sorted(reports, key=lambda report: report["locked"])
    assert first["up"] <= second["locked"], f"the heads started together: {reports}"
