"""The hybrid-engine switch between the FSDP actor (trainer mode) and a colocated SGLang engine (rollout mode).

    with FSDPSGLangShardingManager(actor_module, rollout, trainer_state=...):   # enter: rollout mode
        output = rollout.generate_sequences(prompts)
    # exit: trainer mode

Enter (rollout mode), with `rollout.multi_stage_wake_up` (the order that keeps peak memory lowest):
  1. resume the engine's weight memory only (the contents were lost on release);
  2. stream the full FSDP parameters into it, `rollout.update_weights_bucket_megabytes` at a time,
     cast to `rollout.dtype` into one flat buffer per bucket, through `update_weights_from_tensor`
     (CUDA IPC: the engine copies straight from our GPU buffer, no host round trip). HF names; a
     tied weight is sent once;
  3. park the FSDP parameters / optimizer state in CPU memory if asked (frees room for the KV cache);
  4. resume the KV cache and CUDA graphs; flush the radix cache once (its entries predate the sync).
Without multi_stage_wake_up, step 1 resumes everything at once and step 4 only flushes.
Exit (trainer mode): release the engine's memory (weights, KV cache, CUDA graphs), bring the
parked FSDP state back to the GPU (not with reload_on_exit=False: the worker loads it per phase),
empty the CUDA cache.
With `rollout.free_cache_engine=false` the engine keeps its memory: enter only syncs weights.

GPU memory (allocated/reserved by this process, held by the engine's processes, used on the device)
is logged at each transition and kept, with the timings, in `self.last_switch`.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from hybridrl.utils.fsdp_utils import fsdp_root, hf_module, iter_hf_weights
from hybridrl.utils.offload import FSDPOffload
from hybridrl.workers.rollout.sglang_rollout import ALL_MEMORY_TAGS, EngineDiedError, EngineMemoryError, SGLangRollout
from hybridrl.workers.sharding_manager.base import BaseShardingManager

logger = logging.getLogger(__name__)

GiB = 1 << 30
RESUME_HEADROOM = 256 << 20  # CUDA contexts and allocation granularity: never resume into the last bytes
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class FSDPSGLangShardingManager(BaseShardingManager):
    def __init__(self, module: nn.Module, rollout: SGLangRollout, *, trainer_state: FSDPOffload | None = None,
                 reload_on_exit: bool = True):
        """`module` is the FSDP actor. trainer_state: its parking rules (fsdp_config.param_offload /
        optimizer_offload, utils/offload.py); what they name is parked in CPU memory right after the weight
        sync, so the KV cache gets that room. reload_on_exit brings it back when the rollout ends; the worker
        passes False, since each of its phases loads what it needs (a reload here would be undone at once)."""
        self.module = module
        self.rollout = rollout
        self.trainer_state = trainer_state if trainer_state is not None and trainer_state.parks_anything else None
        self.reload_on_exit = reload_on_exit
        self.config = rollout.config
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.tied_names = tied_parameter_names(hf_module(fsdp_root(module)))  # HF names, as iter_hf_weights
        self.last_switch: dict[str, float] = {}

    # ------------------------------------------------------------------ enter: rollout mode
    def __enter__(self) -> "FSDPSGLangShardingManager":
        try:
            return self._enter_rollout_mode()
        except EngineMemoryError:  # nothing generated: give back what did resume, the trainer keeps its state
            self.rollout.release_memory()
            raise

    def _enter_rollout_mode(self) -> "FSDPSGLangShardingManager":
        self.last_switch = {}
        self._log_memory("trainer mode")
        wake_all_at_once = not self.config.multi_stage_wake_up
        if self.config.free_cache_engine:
            self._resume("resume_weights", ALL_MEMORY_TAGS if wake_all_at_once else ("weights",))
            self._log_memory("engine weights resumed")
        pushed = self._timed("update_weights", self.sync_weights)
        self.last_switch["sync_gbps"] = pushed / max(self.last_switch["update_weights_s"], 1e-9) / 1e9
        self.last_switch["sync_gib"] = pushed / GiB
        if self.trainer_state is not None:
            self._timed("offload_trainer", self.trainer_state.park)
        if self.config.free_cache_engine and not wake_all_at_once:
            self._resume("resume_kv_cache", ("kv_cache", "cuda_graph"))
        self._timed("flush_cache", self.rollout.flush_cache)
        self._log_memory("rollout mode")
        return self

    def _resume(self, stage: str, tags: tuple[str, ...]) -> None:
        """Resume the engine's `tags` once the device has room for them, else fail now with the numbers.

        The trainer's cached blocks go back to the device first (the engine allocates outside torch's
        allocator). A resume that does not fit would kill the engine's scheduler with a CUDA OOM
        (EngineDiedError, the run's real cause buried in its log); this names the cause and the keys instead.
        """
        torch.cuda.empty_cache()
        need = self.rollout.bytes_to_resume(tags)
        free, total = torch.cuda.mem_get_info(self.device)
        if free < need + RESUME_HEADROOM:
            raise EngineMemoryError(
                f"rollout mode: resuming the sglang engine's {list(tags)} needs {need / GiB:.2f} GiB on {self.device}, "
                f"but only {free / GiB:.2f} GiB of {total / GiB:.2f} GiB are free after the trainer returned its cached "
                f"memory (the trainer holds {torch.cuda.memory_allocated(self.device) / GiB:.2f} GiB allocated). "
                f"Make room: lower actor_rollout_ref.rollout.gpu_memory_utilization (now "
                f"{self.config.gpu_memory_utilization}), lower actor_rollout_ref.actor.ppo_max_token_len_per_gpu / "
                f"ppo_micro_batch_size_per_gpu (activation peaks the allocator keeps), or set "
                f"actor_rollout_ref.actor.fsdp_config.param_offload=true and optimizer_offload=true (the trainer's "
                f"state waits in CPU memory during the rollout)")
        self._timed(stage, self.rollout.resume_memory, tags)

    def sync_weights(self) -> int:
        """Push every full parameter into the engine, one flat bucket at a time; returns the bytes pushed.

        Each full parameter is cast to `rollout.dtype` while it is copied into a flat buffer of
        `rollout.update_weights_bucket_megabytes`; a full buffer goes to the engine as ONE CUDA IPC
        handle (SGLang's "flattened_bucket" format) instead of one handle per tensor, which is what
        costs time with ~300 tensors. Every rank must run this (gathering a full parameter is a
        collective under FSDP). FSDP2 gathers one unit (decoder layer) at a time in its compute dtype
        (`iter_unsharded_parameters`), so at most one unit and one bucket of full tensors exist at once.
        A LoRA policy is sent with its adapters merged into the base weights (`iter_hf_weights`).
        """
        bucket = FlatBucket(self.config.update_weights_bucket_megabytes << 20, DTYPES[self.config.dtype], self.device)
        pushed = 0
        for name, tensor in iter_hf_weights(self.module):
            if name in self.tied_names:
                continue
            if not bucket.fits(tensor):
                pushed += self._push(bucket)
            bucket.add(name, tensor)
        if bucket.metadata:
            pushed += self._push(bucket)
        return pushed

    def _push(self, bucket: "FlatBucket") -> int:
        flat, metadata = bucket.take()
        self.rollout.update_weights_flattened(flat, metadata)
        return sum(entry.numel for entry in metadata)

    # ------------------------------------------------------------------ exit: trainer mode
    def __exit__(self, exc_type, exc_value, traceback) -> None:
        try:
            if self.config.free_cache_engine:
                self._timed("release_engine", self.rollout.release_memory)
        except EngineDiedError:
            if exc_value is None:
                raise
            logger.error("could not release the sglang engine while handling %r", exc_value)
        finally:
            if self.trainer_state is not None and self.reload_on_exit:
                self._timed("reload_trainer", self.trainer_state.load, True)
            torch.cuda.empty_cache()
            self._log_memory("trainer mode restored")

    # ------------------------------------------------------------------ timings and memory
    def switch_timing(self) -> dict[str, float]:
        """The last switch's stages as `timing_s/<stage>` metrics (resume_weights, update_weights, offload_trainer,
        resume_kv_cache, flush_cache, release_engine, reload_trainer: whichever ran)."""
        return {f"timing_s/{key[:-2]}": value for key, value in self.last_switch.items()
                if key.endswith("_s") and "/" not in key}

    def _timed(self, stage: str, fn, *args):
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = fn(*args)
        torch.cuda.synchronize()
        self.last_switch[f"{stage}_s"] = time.perf_counter() - started
        return result

    def _log_memory(self, stage: str) -> None:
        memory = gpu_memory(self.rollout.engine_pids())
        for key, value in memory.items():
            self.last_switch[f"{stage}/{key}"] = value
        logger.info("GPU memory, %s: %s", stage, ", ".join(f"{key} {value:.2f} GiB" for key, value in memory.items()))


class FlatBucket:
    """Full tensors cast into one flat uint8 CUDA buffer, with SGLang's per-tensor metadata to cut it up again.

    The buffer is allocated at the first `add` (at least `capacity` bytes, more for a larger tensor)
    and handed over by `take`; each entry starts at a 256-byte boundary, so every view is aligned.
    """

    ALIGN = 256

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device):
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        self.metadata_cls = FlattenedTensorMetadata
        self.capacity, self.dtype, self.device = capacity, dtype, device
        self.buffer: torch.Tensor | None = None
        self.metadata: list = []
        self.used = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        """True when the bucket is empty (a new buffer is sized to take it) or has room for `tensor`."""
        return not self.metadata or self.used + self._size(tensor) <= self.buffer.numel()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if not self.fits(tensor):
            raise RuntimeError(f"FlatBucket.add({name!r}): no room; take() the bucket first")
        if self.buffer is None:
            self.buffer = torch.empty(max(self.capacity, self._size(tensor)), dtype=torch.uint8, device=self.device)
        numel = tensor.numel() * self.dtype.itemsize
        self.buffer[self.used:self.used + numel].view(self.dtype).view(tensor.shape).copy_(tensor)
        self.metadata.append(self.metadata_cls(name=name, shape=tensor.shape, dtype=self.dtype,
                                               start_idx=self.used, end_idx=self.used + numel, numel=numel))
        self.used += self._size(tensor)

    def take(self) -> tuple[torch.Tensor, list]:
        """The filled part of the buffer and its metadata; the bucket is empty (and unallocated) afterwards."""
        flat, metadata = self.buffer[:self.used], self.metadata
        self.buffer, self.metadata, self.used = None, [], 0
        return flat, metadata

    def _size(self, tensor: torch.Tensor) -> int:
        nbytes = tensor.numel() * self.dtype.itemsize
        return -(-nbytes // self.ALIGN) * self.ALIGN


def tied_parameter_names(model: nn.Module) -> set[str]:
    """Names under which an already-named parameter appears again (e.g. lm_head.weight tied to the embeddings).

    The engine ties them itself, so sending the first name is enough (and saves vocab x hidden bytes).
    """
    seen: set[int] = set()
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    return tied


def gpu_memory(engine_pids: list[int]) -> dict[str, float]:
    """GiB: this process's torch allocator (allocated, reserved), the engine processes (NVML), the device in use."""
    import pynvml

    device = torch.cuda.current_device()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))  # CUDA_VISIBLE_DEVICES-aware
    engine_bytes = sum(process.usedGpuMemory or 0 for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                       if process.pid in set(engine_pids))
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device) / GiB, "reserved": torch.cuda.memory_reserved(device) / GiB,
            "engine": engine_bytes / GiB, "device_used": (total - free) / GiB}
