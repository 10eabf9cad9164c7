"""Worker: the base of every class a RayWorkerGroup runs, one instance per rank.

A worker learns where it stands from environment variables that the group sets on its Ray actor
before the class is constructed: RANK, WORLD_SIZE, LOCAL_RANK (index among the ranks of its
node's placement group) and HYBRIDRL_RENDEZVOUS_KEY, under which rank 0 publishes the torch.distributed
rendezvous it listens on (rendezvous.py). Before anything else, the Worker turns that key into MASTER_ADDR/MASTER_PORT:
the same names torchrun uses, so torch.distributed's env:// init reads them as is.

To run a worker outside a group (a unit test in one process), set the five variables yourself,
e.g. RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=<a free port>.

A group that watches its ranks also names its heartbeat monitor (HYBRIDRL_HEARTBEAT_MONITOR/_INTERVAL); the
worker then starts the process's heartbeat thread first thing, so it beats while its roles load (heartbeat.py).

CPU threads follow Ray's default: OMP_NUM_THREADS is the actor's CPU share (1 per bundle, so a
2-core machine is not oversubscribed). To give workers more threads, export OMP_NUM_THREADS before the
run starts: Ray then leaves it as it is (a local cluster's workers inherit the driver's environment, a
running cluster's the environment its `ray start` had). vLLM's engine loop runs in the rollout worker's
process: alone (benchmarks/hybrid_engine.py) it generated 1.19x faster at 16 threads than at 1, but in a
trainer run 16 threads gave the same generation time as 1 (benchmarks/README.md, "vLLM's generation at the
trainer's thread count"), so the workers keep Ray's count.
"""
from __future__ import annotations

import os

from hybridrl.single_controller.rendezvous import KEY_ENV, resolve_rendezvous

WORKER_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class Worker:
    def __init__(self) -> None:
        if KEY_ENV in os.environ and "RANK" in os.environ and "MASTER_PORT" not in os.environ:
            # Once per process: the roles of a colocated worker are Workers too, and each runs this __init__.
            resolve_rendezvous(int(os.environ["RANK"]), os.environ[KEY_ENV])
        missing = [name for name in WORKER_ENV_VARS if name not in os.environ]
        if missing:
            raise RuntimeError(f"{type(self).__name__}: environment variable(s) {missing} are not set; a "
                               f"RayWorkerGroup sets them, or set {list(WORKER_ENV_VARS)} to run one worker alone")
        self._rank = int(os.environ["RANK"])
        # Imported here, not at the top: importing this package must not import ray, because the driver sets
        # Ray's single-machine mode before its first `import ray` (local_cluster.py).
        from hybridrl.single_controller.heartbeat import start_heartbeat

        start_heartbeat(self._rank)
        self._world_size = int(os.environ["WORLD_SIZE"])
        self._local_rank = int(os.environ["LOCAL_RANK"])

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        return self._local_rank

