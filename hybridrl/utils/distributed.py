"""torch.distributed set-up shared by every worker role.

The CPU path and the GPU path are the same code: only the device ("cpu"/"cuda") and the
backend ("gloo"/"nccl") differ, and both are chosen here.

Nothing listens on more interfaces than the run needs: torch's rendezvous store (env://) listens on every interface
of rank 0's machine, so rank 0 hosts it on MASTER_ADDR alone (under torchrun, whose agent hosts the store, env:// is
used as is); and when MASTER_ADDR is a loopback address (a single-machine cluster on 127.0.0.1), gloo's and NCCL's
own sockets are kept on the loopback interface too (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME, unless already set).

A store's port is never found free in one place and bound in another: the process that will host the store reserves
it (reserve_port listens on it at once) and its store takes that very socket over (take_listener).
"""
from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket

import torch
import torch.distributed as dist

RENDEZVOUS_ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def environment_variable(name: str, value: str):
    """os.environ[name] = value inside (what a process started there, or a library reading it at start, sees),
    restored afterwards (removed when it was unset)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


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
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_addr, master_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if _is_loopback(master_addr):
        loopback = _loopback_interface()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Started by torchrun / torch's elastic launcher (main_sft): its agent already hosts the store on MASTER_PORT.
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        return
    dist.init_process_group(backend=backend, store=_rendezvous_store(master_addr, master_port, rank, world_size),
                            rank=rank, world_size=world_size)


def _rendezvous_store(master_addr: str, master_port: int, rank: int, world_size: int) -> dist.TCPStore:
    """The TCPStore env:// would make, except that rank 0 listens on MASTER_ADDR alone (torch's own listens on every
    interface): it hands the store the socket it reserved there."""
    timeout = datetime.timedelta(minutes=30)  # torch's default for the default process group
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    return dist.TCPStore(master_addr, master_port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=take_listener(master_addr, master_port).detach())  # the store owns it now


_reserved_listeners: dict[int, socket.socket] = {}
"""The sockets reserve_port listens on, by port, until a store takes them over."""


def reserve_port(address: str) -> int:
    """A port on `address` this process listens on from now on, for a store it will host (take_listener). Until then
    connections wait in the socket's backlog."""
    listener = socket.create_server((address, 0), family=_family(address))
    port = listener.getsockname()[1]
    _reserved_listeners[port] = listener
    return port


def take_listener(address: str, port: int) -> socket.socket:
    """The socket reserved for `port`, handed over; one bound now when none is (MASTER_PORT set by hand)."""
    listener = _reserved_listeners.pop(port, None)
    return listener if listener is not None else socket.create_server((address, port), family=_family(address))


def release_port(port: int) -> None:
    """Close the socket reserved for `port`, for a library that binds the port itself right after."""
    listener = _reserved_listeners.pop(port, None)
    if listener is not None:
        listener.close()


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def _loopback_interface() -> str:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.family == socket.AF_INET and address.address.startswith("127.") for address in addresses):
            return name
    raise RuntimeError("MASTER_ADDR is a loopback address but this machine has no interface with a 127.x address")


def is_distributed() -> bool:
    """Whether this process is in an initialised torch.distributed group."""
    return dist.is_available() and dist.is_initialized()


def rank_or_zero() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size_or_one() -> int:
    return dist.get_world_size() if is_distributed() else 1


def barrier_if_distributed() -> None:
    if is_distributed():
        dist.barrier()
