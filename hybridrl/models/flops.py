"""Model FLOPs of a decoder-only transformer from its HF config, the device's peak, and MFU.

MFU = the FLOPs the model's math needs for the real (unpadded) tokens / (seconds x devices x peak).
The count is PaLM's (appendix B), the convention verl and nanoGPT report under `perf/mfu/*`:

    forward FLOPs = 2 x dense_params x tokens  +  4 x layers x heads x head_dim x sum(seqlen^2)

- dense_params: the matmul weights a token passes through: per layer q, k, v, o (GQA-sized k/v) and the
  MLP (gate, up, down for SwiGLU: 3 x hidden x intermediate), plus the output layer (vocab x hidden).
  The embedding lookup is not a matmul and is not counted (verl counts it like the output layer, which
  puts its MFU a little higher for large vocabularies).
- attention: QK^T and PV, 2 x 2 x seqlen^2 x head_dim per head and layer, over the full square (not half
  for causal masking), per sequence: packed sequences do not attend to each other.
- a training pass is forward + backward = 3 x forward. Recomputation (gradient checkpointing) is not
  counted: it is work the model's math does not need (that would be HFU, not MFU).
"""
from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

# Dense bf16 tensor-core peak per device, TFLOP/s (vendor datasheets, without sparsity).
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "H20": 148.0, "B200": 2250.0, "A100": 312.0,
                    "A800": 312.0, "L40S": 362.1, "L4": 121.0, "A10": 125.0}


def dense_parameters(config) -> int:
    """Matmul weights one token passes through (see the module docstring), from a Llama/Qwen2-style HF config."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o: heads; k and v: kv heads
    mlp = 3 * hidden * config.intermediate_size
    return layers * (attention + mlp) + config.vocab_size * hidden


def forward_flops(config, seqlens: Sequence[int]) -> float:
    """FLOPs of one forward pass over sequences of these token counts."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    tokens = sum(seqlens)
    square_sum = sum(length * length for length in seqlens)
    return 2.0 * dense_parameters(config) * tokens + 4.0 * config.num_hidden_layers * heads * head_dim * square_sum


def peak_flops(device: str | torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s; None on a CPU or an unlisted GPU (no MFU is reported then)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> float | None:
    """FLOP/s of a CUDA device name as torch reports it ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB")."""
    words = set(re.split(r"[\s_-]+", device_name))
    return next((tflops * 1e12 for model, tflops in PEAK_BF16_TFLOPS.items() if model in words), None)


def supports(config) -> bool:
    """Whether `config` has the fields the count needs (dense decoder-only; MoE configs are not counted)."""
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    is_moe = any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    return all(isinstance(getattr(config, key, None), int) for key in needed) and not is_moe


def model_flops_utilization(config, seqlens: Sequence[int], seconds: float, device: str | torch.device,
                            passes: float = 1.0) -> float | None:
    """MFU of `passes` forward-equivalents (3 per training pass) over this rank's sequences in `seconds`.

    Over all data-parallel ranks when torch.distributed is up (every rank must call it): the FLOPs add up,
    the time is the slowest rank's, the peak is the sum of the devices'. None without a known peak.
    """
    peak = peak_flops(device)
    if peak is None or not supports(config):
        return None
    totals = torch.tensor([passes * forward_flops(config, seqlens), seconds, peak], dtype=torch.float64,
                          device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        flops_and_peaks = totals[[0, 2]].clone()
        dist.all_reduce(flops_and_peaks)
        slowest = totals[1:2].clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        totals = torch.stack([flops_and_peaks[0], slowest[0], flops_and_peaks[1]])
    flops, seconds, peak = totals.tolist()
    return flops / (seconds * peak) if seconds > 0 else None
