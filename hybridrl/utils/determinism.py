"""Bitwise reproducibility of one process (verl's `fsdp_config.full_determinism`), and seeds that every process and
every run derive alike.

torch picks fast kernels whose reductions may add in a different order from one call to the next (atomics, cuBLAS's
split-K workspaces, cuDNN's autotuner): two runs then drift apart by rounding, and an RL run amplifies that into
different samples. `enable_full_determinism` asks for the deterministic kernels, as torch's notes on randomness
(https://pytorch.org/docs/stable/notes/randomness.html) and verl's `enable_full_determinism` do. It costs speed on a
GPU (benchmarks/README.md) and nothing measurable on a CPU, whose kernels here are deterministic already.

`stable_seed` is not Python's `hash()`, which is salted per process (PYTHONHASHSEED).
"""
from __future__ import annotations

import hashlib
import os
import random

import numpy as np
import torch

# Read by cuBLAS, transformers' flash-attention path and NCCL when they start their first kernel or communicator:
# enable_full_determinism must run before the process touches CUDA or NCCL.
DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",    # cuBLAS: fixed workspaces (torch refuses deterministic mode without)
    "FLASH_ATTENTION_DETERMINISTIC": "1",    # transformers passes deterministic=True to flash-attn's backward
    "NCCL_ALGO": "Ring",                     # one reduction order for all-reduce / reduce-scatter across runs
    "NCCL_PROTO": "Simple",
}


def enable_full_determinism(seed: int) -> None:
    """Deterministic torch kernels from now on in this process, and Python's, numpy's and torch's RNGs seeded.

    warn_only: an op with no deterministic kernel warns (once, naming it) instead of failing the run, as in verl;
    the GPU gate (tests/gpu/test_determinism_gpu.py) is what shows that no such op changed a bit."""
    os.environ.update(DETERMINISTIC_ENV)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def stable_seed(*parts: int | str | bool) -> int:
    """A seed in [0, 2**31) from `parts`: the same in every process and every run, and unrelated for different
    parts (a BLAKE2 digest of their repr)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31
