"""Memory metrics under verl's names: the device allocator's peaks and the host's memory in use."""
from __future__ import annotations

import psutil
import torch

GiB = 1 << 30


def memory_metrics(device: str | torch.device, engine_bytes: int = 0) -> dict[str, float]:
    """perf/max_memory_allocated_gb and perf/max_memory_reserved_gb: this process's CUDA peaks since the previous
    call (the peaks are reset, so each step reports its own); perf/cpu_memory_used_gb: the host's memory in use.

    engine_bytes: what an engine in this process keeps in torch's allocator for its whole life (the rollout's
    `allocator_bytes`: vLLM's tensors, allocated even while it sleeps), left out of both peaks so they are the
    trainer's (its whole allocations: the pool reserves what it allocates, up to the allocator's rounding)."""
    metrics = {"perf/cpu_memory_used_gb": psutil.virtual_memory().used / GiB}
    device = torch.device(device)
    if device.type == "cuda":
        metrics["perf/max_memory_allocated_gb"] = (torch.cuda.max_memory_allocated(device) - engine_bytes) / GiB
        metrics["perf/max_memory_reserved_gb"] = (torch.cuda.max_memory_reserved(device) - engine_bytes) / GiB
        torch.cuda.reset_peak_memory_stats(device)
    return metrics
