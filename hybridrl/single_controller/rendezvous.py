"""Where a worker group's ranks meet for torch.distributed: rank 0 listens first, then tells the others.

A port that one process finds free and another binds seconds later can be taken in between: outgoing connections
draw their ports from the same range, and Ray's own make many. So no port is picked ahead. The group gives its
ranks a key (HYBRIDRL_RENDEZVOUS_KEY); as each rank's Worker starts, rank 0 listens on a port of its node's address
(utils/distributed.reserve_port holds the socket for the store it will host) and publishes "address port" under the
key in Ray's key-value store, and the other ranks wait for it. Each rank then has MASTER_ADDR and MASTER_PORT in its
environment, as under torchrun, before any role is built. The pool deletes its keys when it is removed.
"""
from __future__ import annotations

import os
import time

KEY_ENV = "HYBRIDRL_RENDEZVOUS_KEY"
NAMESPACE = "hybridrl_rendezvous"
WAIT_S = 30 * 60  # torch's default timeout for the default process group's rendezvous
POLL_S = 0.02


def resolve_rendezvous(rank: int, key: str, wait_s: float = WAIT_S) -> tuple[str, int]:
    """Rank 0: reserve a port on this node and publish it under `key`. Other ranks: wait for rank 0's. Sets
    MASTER_ADDR/MASTER_PORT in this process's environment and returns them."""
    import ray
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_put

    from hybridrl.utils.distributed import reserve_port

    if rank == 0:
        address = ray.util.get_node_ip_address()
        port = reserve_port(address)
        _internal_kv_put(key, f"{address} {port}", namespace=NAMESPACE)
    else:
        deadline = time.monotonic() + wait_s
        while (published := _internal_kv_get(key, namespace=NAMESPACE)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: rank 0 did not publish the rendezvous address under {key!r} within "
                                   f"{wait_s:g} s (did rank 0's worker start?)")
            time.sleep(POLL_S)
        address, port = published.decode().split()
        port = int(port)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    return address, port


def forget_rendezvous(key_prefix: str) -> None:
    """Delete every key under `key_prefix` (a pool's, when it is removed)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(key_prefix, del_by_prefix=True, namespace=NAMESPACE)
