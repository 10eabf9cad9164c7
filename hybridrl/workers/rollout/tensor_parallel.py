"""Tensor-parallel engines: one engine per `rollout.tensor_model_parallel_size` GPUs, driven by its group's ranks.

Every rank stays what it is without tensor parallelism: one Ray worker, one GPU, one FSDP shard, one slice of the
batch. The k ranks of a group (consecutive global ranks, as verl's infer_tp mesh) share one engine that spans their k
GPUs. The group's first rank (the leader) owns the engine's processes; all k ranks take part in every lifecycle
call (rollout/base.py), so the trainer loop and the mode switch do not change:

- update_weights: every rank gathers the full tensors (FSDP's all-gather needs all ranks anyway) into a flat bucket
  on its own GPU and sends the leader a CUDA IPC handle of it; the leader hands the engine one handle per TP rank
  (SGLang's "flattened_bucket" load format takes tp_size payloads), so TP rank i copies from GPU i and no weight
  crosses a GPU link. The ranks keep their bucket until the engine has copied it.
- generate_sequences: the ranks' prompts go to the leader (token ids over a gloo group: small), which generates
  them in one engine call and sends each rank its own rows back. The data-parallel split follows the engines.
- resume: each rank first returns its cached blocks and checks that its own GPU has room for the engine's share
  (the engine takes the same on each GPU), so a resume that cannot fit fails on every rank with the numbers,
  before any engine process runs out of memory. release: the leader's engine frees all k GPUs.
A call that fails on the leader fails on every rank of the group with the leader's error (never a rank waiting
forever for a collective the leader left).

vllm spans GPUs its own way, each rank holding its shard in process (vllm_rollout.py), with this module's
TensorParallelGroup for its prompts; hf generates from the FSDP module itself.

rollout.mode=async: the leader's engine server answers the group's requests (async_server.build_engine_server; the
other ranks serve none), and the agent loops spread requests over the leaders' servers. The lifecycle calls above
stay the group's. On the separate rollout pool (hybrid_engine=false) the groups are the pool's ranks and the weights
come from the trainer pool over NCCL, straight into the leader's engine (init_weights_update_group). Refused at
validation (rollout/config_checks.py): vllm's tensor parallelism outside rollout.mode=sync (its ranks step together
on the same prompts).
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybridrl.protocol import DataProto
from hybridrl.utils.distributed import environment_variable
from hybridrl.workers.rollout.engine_io import RESUME_HEADROOM, resume_memory_error
from hybridrl.workers.rollout.sglang_weights import DTYPES, FlatBucket, bucket_capacity


class EngineGroupError(RuntimeError):
    """Raised on the non-leader ranks of a group when the call failed on the leader (its error in the message)."""


class TensorParallelGroup:
    """This rank's group of `size` consecutive ranks, with object collectives rooted at the group's first rank."""

    def __init__(self, size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        if size < 1 or world % size:
            raise ValueError(f"rollout.tensor_model_parallel_size={size} must divide the world size {world}")
        self.size, self.rank, self.leader = size, rank % size, rank - rank % size
        # every rank creates every group (torch.distributed's rule), then keeps its own; gloo: the payloads are
        # Python objects (token ids, IPC handles), and the trainer's NCCL streams are left alone
        groups = [dist.new_group(list(range(start, start + size)), backend="gloo") for start in range(0, world, size)]
        self.group = groups[rank // size]

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list | None:
        """Every rank's `obj` on the leader (in group-rank order); None elsewhere."""
        out = [None] * self.size if self.is_leader else None
        dist.gather_object(obj, out, dst=self.leader, group=self.group)
        return out

    def scatter(self, objs: list | None) -> Any:
        """objs[i] from the leader to group rank i."""
        out = [None]
        dist.scatter_object_list(out, objs if self.is_leader else None, src=self.leader, group=self.group)
        return out[0]

    def broadcast(self, obj: Any) -> Any:
        holder = [obj]
        dist.broadcast_object_list(holder, src=self.leader, group=self.group)
        return holder[0]

    def all_gather(self, obj: Any) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def on_leader(self, fn: Callable, *args) -> Any:
        """Run fn on the leader; its result is returned there. If it raises, the leader re-raises and the other
        ranks raise EngineGroupError with its message, so no rank is left waiting in a later collective."""
        result, error = None, None
        if self.is_leader:
            try:
                result = fn(*args)
            except BaseException as err:  # noqa: BLE001 - reported to the group, then re-raised
                error = err
        failure = self.broadcast(None if error is None else f"{type(error).__name__}: {error}\n"
                                 f"{''.join(traceback.format_exception(error))}")
        if error is not None:
            raise error
        if failure is not None:
            raise EngineGroupError(f"the rollout engine of ranks {self.leader}..{self.leader + self.size - 1} failed "
                                   f"on rank {self.leader}: {failure}")
        return result


def physical_gpu_id() -> str:
    """This process's GPU as the machine numbers it (Ray gives each worker one GPU through CUDA_VISIBLE_DEVICES)."""
    device = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[device].strip() if visible else str(device)


def visible_devices(gpu_ids: list[str]):
    """CUDA_VISIBLE_DEVICES for the processes started inside (an engine's TP workers), restored afterwards; this
    process keeps the CUDA context it has."""
    return environment_variable("CUDA_VISIBLE_DEVICES", ",".join(gpu_ids))


class TensorParallelRollout:
    """The lifecycle contract for one rank of a TP group; the engine (leader only) is built by `make_engine(gpu_ids)`,
    where gpu_ids are the group's GPUs in TP-rank order (the engine spans them, TP rank i on gpu_ids[i]).
    model_path: the engine's checkpoint, whose size caps each rank's weight bucket (the same on every rank, so
    bucket boundaries agree)."""

    shares_trainer_weights = False
    allocator_bytes = 0  # the engine (sglang) runs in its own processes: nothing in this one's torch allocator

    def __init__(self, config, make_engine: Callable[[list[str]], Any], model_path: str):
        self.config = config
        self.bucket_bytes = bucket_capacity(config.update_weights_bucket_megabytes, DTYPES[config.dtype], model_path)
        self.tp = TensorParallelGroup(config.tensor_model_parallel_size)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        gpu_ids = self.tp.all_gather(physical_gpu_id() if torch.cuda.is_available() else str(self.tp.rank))
        self.engine = self.tp.on_leader(make_engine, gpu_ids)

    @property
    def weights_survive_release(self) -> bool:
        return not self.config.free_cache_engine

    # ------------------------------------------------------------------ lifecycle (rollout/base.py)
    def resume(self, tags: tuple[str, ...]) -> None:
        self._check_room(tags)
        self.tp.on_leader(self.engine.resume if self.tp.is_leader else None, tags)

    def release(self, tags: tuple[str, ...]) -> None:
        self.tp.on_leader(self.engine.release if self.tp.is_leader else None, tags)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def update_weights(self, named_tensors) -> None:
        """Each rank fills its own buckets with the same tensors in the same order (so bucket boundaries agree)."""
        bucket = self.new_bucket()
        for name, tensor in named_tensors:
            if not bucket.fits(tensor):
                self._push(bucket)
            bucket.add(name, tensor)
        if bucket.metadata:
            self._push(bucket)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        parts = self.tp.gather(prompts)

        def generate_all() -> list[DataProto]:
            output = self.engine.generate_sequences(DataProto.concat(parts))
            starts = [sum(len(part) for part in parts[:index]) for index in range(len(parts) + 1)]
            return [output[starts[index]:starts[index + 1]] for index in range(len(parts))]
        return self.tp.scatter(self.tp.on_leader(generate_all))

    def take_metrics(self) -> dict[str, float]:
        return self.tp.broadcast(self.engine.take_metrics() if self.tp.is_leader else None)

    # ------------------------------------------------------------------ weights from the trainer pool (NCCL)
    def init_weights_update_group(self, master_address: str, master_port: int, rank: int, world_size: int,
                                  group_name: str) -> None:
        """hybrid_engine=false: join the trainer's weight-transfer group (workers/weight_transfer_worker.py), where
        rollout rank r is member 1 + r. The engine's TP workers join it themselves, TP worker i as rank_offset + i
        (SGLang's rule), so the leader's engine joins with the leader's own member rank as offset and covers the
        group's k members; the other ranks have nothing to join."""
        self.tp.on_leader(self.engine.init_weights_update_group if self.tp.is_leader else None,
                          master_address, master_port, rank, world_size, group_name)

    def update_weights_from_distributed(self, bucket: list, group_name: str) -> None:
        """One broadcast bucket, received by the engine's TP workers straight from the trainer's rank 0."""
        self.tp.on_leader(self.engine.update_weights_from_distributed if self.tp.is_leader else None, bucket,
                          group_name)

    # ------------------------------------------------------------------ parts
    def _check_room(self, tags: tuple[str, ...]) -> None:
        """Every GPU of the group needs room for the engine's share of `tags` (the leader's engine knows it: what
        it measured at start, less what is awake); a shortfall anywhere fails the resume on every rank with that
        GPU's numbers."""
        need = self.tp.broadcast(self.engine.resume_need(tags) if self.tp.is_leader else None)
        reports = self.tp.all_gather(self.device_memory() if need else None)
        for rank, report in enumerate(reports):
            if report is not None and report[0] < need + RESUME_HEADROOM:
                raise resume_memory_error("tensor-parallel sglang", tags, need, *report, self.config,
                                          on=f"TP rank {rank}'s GPU")

    def device_memory(self) -> tuple[int, int, int] | None:
        """(free, total, allocated by the trainer) bytes of this rank's GPU once its cached blocks are returned."""
        if self.device is None:
            return None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return free, total, torch.cuda.memory_allocated(self.device)

    def _push(self, bucket) -> None:
        flat, metadata = bucket.take()
        payloads = self.tp.gather(self.serialize(flat, metadata))
        self.tp.on_leader(self.engine.update_weights_payloads if self.tp.is_leader else None, payloads)
        del flat  # every TP rank of the engine has copied from it (on_leader returned on every rank)

    # the CUDA IPC boundary (sglang's bucket and serializer); a CPU test replaces these two
    def new_bucket(self):
        return FlatBucket(self.bucket_bytes, DTYPES[self.config.dtype], self.device)

    @staticmethod
    def serialize(flat: torch.Tensor, metadata: list) -> bytes:
        from sglang.srt.utils import MultiprocessingSerializer

        return MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata})
