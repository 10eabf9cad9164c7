"""torch.distributed set-up shared by every worker role.

The CPU path and the GPU path are the same code: only the device ("cpu"/"cuda") and the
backend ("gloo"/"nccl") differ, and both are chosen here.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

RENDEZVOUS_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def device_name() -> str:
    """"cuda" when a GPU is visible to this process, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_process_group_once(backend: str | None = None) -> None:
    """Join the default process group described by RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT.

    Colocated roles (actor, rollout, ref, critic) share one process, so each role calls this and
    only the first call initialises; a later call that asks for another backend is an error.
    The backend defaults to nccl with a GPU and gloo without. On a GPU the current device becomes
    LOCAL_RANK modulo the visible devices (0 when Ray gives each worker its own GPU).
    """
    backend = backend or ("nccl" if device_name() == "cuda" else "gloo")
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise RuntimeError(f"init_process_group_once: the process group already uses backend "
                               f"{dist.get_backend()!r}, a role asked for {backend!r}")
        return
    missing = [name for name in RENDEZVOUS_ENV_VARS if name not in os.environ]
    if missing:
        raise RuntimeError(f"init_process_group_once: environment variable(s) {missing} are not set; "
                           f"a RayWorkerGroup sets them for its workers")
    if device_name() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def get_node_ip_and_free_port() -> tuple[str, int]:
    """This node's IP as Ray sees it and a TCP port that is free right now (for MASTER_ADDR/MASTER_PORT)."""
    import ray

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port
