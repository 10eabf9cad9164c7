"""SGLang's side of the weight sync: the flat CUDA buckets the engine loads in one IPC handle each, and the
GPU memory gauges logged at each switch. FlatBucket and gpu_memory need sglang and CUDA (rollout.name=sglang);
bucket_capacity reads only the checkpoint's headers."""
from __future__ import annotations

import math

import torch

from hybridrl.utils.safetensors_header import checkpoint_shapes

GiB = 1 << 30
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
        return self.aligned(tensor.numel() * self.dtype.itemsize)

    @classmethod
    def aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls.ALIGN) * cls.ALIGN


def bucket_capacity(megabytes: int, dtype: torch.dtype, model_path: str) -> int:
    """Bytes of one flat bucket: `rollout.update_weights_bucket_megabytes`, but no more than the whole checkpoint
    at `model_path` in the rollout dtype, each tensor aligned as FlatBucket aligns it. The buffer is allocated whole
    on the trainer's GPU, so without the cap a 0.7 MB model held verl's 2 GiB default at every sync. A checkpoint
    that is not safetensors (nothing to read cheaply) gets the configured size."""
    configured = megabytes << 20
    shapes = checkpoint_shapes(model_path)
    if shapes is None:
        return configured
    model_bytes = sum(FlatBucket.aligned(math.prod(shape) * dtype.itemsize) for shape in shapes)
    return min(configured, model_bytes)


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
