"""Weights from the trainer pool to the rollout pool (actor_rollout_ref.hybrid_engine=false), over a process group
of their own.

    group rank 0        trainer rank 0: the sender. Every trainer rank walks iter_rollout_weights (gathering a
                        full tensor is a collective of the trainer's FSDP group); rank 0 broadcasts each one.
    group ranks 1..R    the rollout ranks, one per engine: each receives every tensor.

The group is a real torch.distributed group beside each side's default one (which spans only its own pool):
gloo on CPU (`WeightTransferGroup`, a TCPStore rendezvous plus ProcessGroupGloo), NCCL on GPU, where SGLang's
engine joins it itself (`init_weights_update_group`) and receives with `update_weights_from_distributed`; the
trainer then joins through SGLang's own `init_custom_process_group`, so both sides rendezvous the same way.

Bucketing: the tensors are cut into buckets of at most `rollout.update_weights_bucket_megabytes` (a tensor larger
than that is a bucket of its own). A receiver holds one bucket at a time and loads it before the next: SGLang gets
one `update_weights_from_distributed(names, dtypes, shapes)` call per bucket, the hf engine one load into its
module. Every tensor is one broadcast, in the order of `TensorMeta`s the controller got from the sender once at
set-up (`describe`); the sender checks each tensor against it, so the two sides cannot silently disagree.

Pausing and the lock: the rollout worker stops its engine server before the first bucket (requests being generated
finish first; new ones wait) and serves again only after the last one, with the new version: no request sees half
a model (workers/actor_rollout_ref.py `receive_weights`).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from hybridrl.utils.distributed import release_port, take_listener

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
GROUP_NAME = "hybridrl_weight_transfer"


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # "float32" | "bfloat16" | "float16" (SGLang's spelling)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * getattr(torch, self.dtype).itemsize


def describe(named_tensors: Iterable[tuple[str, torch.Tensor]], wire_dtype: str | None = None) -> list[TensorMeta]:
    """The metadata of a weight stream, in its order; wire_dtype: every tensor is sent cast to it (an engine that
    holds bf16 weights gets bf16: half the bytes of fp32), None: as the stream yields it."""
    metas = []
    for name, tensor in named_tensors:
        if tensor.dtype not in DTYPE_NAMES:
            raise TypeError(f"weight transfer: {name} has dtype {tensor.dtype}; expected one of {list(DTYPE_NAMES)}")
        metas.append(TensorMeta(name, wire_dtype or DTYPE_NAMES[tensor.dtype], tuple(tensor.shape)))
    return metas


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Consecutive runs of tensors of at most bucket_bytes each (a larger tensor alone)."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for meta in metas:
        if not buckets or size + meta.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(meta)
        size += meta.nbytes
    return buckets


class WeightTransferGroup:
    """A gloo (CPU) or NCCL group of the sender and the receivers, created beside the default process group.

    Rank 0 hosts the rendezvous store at master_addr:master_port, on the socket it reserved there when it gave out the
    address (utils/distributed.reserve_port); every member must construct it (it blocks until all world_size members
    have joined)."""

    def __init__(self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str,
                 timeout_s: float = 600.0):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        if backend == "nccl":  # SGLang's engines join with this same helper: same store layout and group name
            if rank == 0:
                release_port(master_port)  # the helper binds it itself, a moment later
            try:
                from sglang.srt.utils import init_custom_process_group
            except ImportError:  # newer SGLang keeps it in the submodule only
                from sglang.srt.utils.common import init_custom_process_group

            self._group = init_custom_process_group(backend="nccl", init_method=f"tcp://{master_addr}:{master_port}",
                                                    world_size=world_size, rank=rank, group_name=GROUP_NAME,
                                                    timeout=timeout)
            self._backend_pg = None
            return
        if backend != "gloo":
            raise ValueError(f"WeightTransferGroup: backend must be gloo or nccl, got {backend!r}")
        if rank == 0:
            store = dist.TCPStore(master_addr, master_port, world_size, is_master=True, timeout=timeout,
                                  master_listen_fd=take_listener(master_addr, master_port).detach())
        else:
            store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
        self._backend_pg = dist.ProcessGroupGloo(dist.PrefixStore(f"{GROUP_NAME}/", store), rank, world_size, timeout)
        self._store = store  # the master's store must live as long as the group

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every member's `tensor` (same shape and dtype everywhere)."""
        if self._backend_pg is None:
            dist.broadcast(tensor, group=self._group, group_src=0)
            return
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self._backend_pg.broadcast([tensor], options).wait()


def send_weights(named_tensors: Iterator[tuple[str, torch.Tensor]], metas: list[TensorMeta],
                 group: WeightTransferGroup | None) -> int:
    """Walk the trainer's weight stream (every trainer rank must: it gathers); the member of the group (trainer
    rank 0, `group` not None) broadcasts each tensor, cast to its TensorMeta's dtype. Returns the bytes sent (0 on
    the other ranks)."""
    sent = 0
    index = 0
    for name, tensor in named_tensors:
        if index >= len(metas) or (metas[index].name, metas[index].shape) != (name, tuple(tensor.shape)):
            expected = metas[index] if index < len(metas) else "the end of the stream"
            raise RuntimeError(f"send_weights: tensor {index} is {name} {tuple(tensor.shape)}, the receivers expect "
                               f"{expected} (the weight stream changed since describe())")
        if group is not None:
            tensor = tensor.to(getattr(torch, metas[index].dtype)).contiguous()
            group.broadcast(tensor)
            sent += tensor.numel() * tensor.element_size()
        index += 1
    if index != len(metas):
        raise RuntimeError(f"send_weights: the stream ended after {index} tensors, the receivers expect {len(metas)}")
    return sent


def receive_bucket(bucket: list[TensorMeta], group: WeightTransferGroup,
                   device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    """The full tensors of one bucket, received from rank 0 in order."""
    received = []
    for meta in bucket:
        tensor = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=device)
        group.broadcast(tensor)
        received.append((meta.name, tensor))
    return received


def load_full_tensors(module: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy full (unsharded) tensors into a FSDP1/FSDP2 module (each rank holds them all; each keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    result = set_model_state_dict(module, dict(named_tensors),
                                  options=StateDictOptions(full_state_dict=True, strict=False))
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise KeyError(f"load_full_tensors: the rollout's model has no parameter(s) {unexpected[:5]} (the trainer's "
                       f"and the rollout's models differ)")
