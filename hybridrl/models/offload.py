"""Park an FSDP2 model's parameters and its optimizer's state in CPU memory between phases
(verl's `fsdp_config.param_offload` / `fsdp_config.optimizer_offload`).

A hybrid-engine rank runs one phase at a time (generate, log-probs, values, update) and several models
share its GPU (actor, reference, critic, the rollout engine's KV cache). A model's state that the
current phase does not use only takes room from the phase that runs. So, with the flags on:
  param_offload      the local shards of the FSDP parameters live in CPU memory and come to the
                     compute device only for a phase that computes with them; their gradients are
                     dropped when the phase ends (every update starts with zero_grad, so they are
                     dead values, and moving them would cost a parameter-sized transfer each way);
  optimizer_offload  the optimizer's state (AdamW's two moments: twice the fp32 parameters) lives
                     in CPU memory and comes to the device only for the update (and for checkpoints).

    offload = FSDPOffload(module, optimizer, param_offload=True, optimizer_offload=True, device="cuda")
    offload.park()                          # once, after building: state starts in CPU memory
    with offload.loaded():                  # log-probs: parameters on the device
        ...
    with offload.loaded(optimizer=True):    # update / checkpoint: parameters and optimizer state
        ...

It is the same code on a CPU-only machine, where the compute device is the CPU and every move is a
no-op. Only FSDP2 (`fully_shard`) modules are supported: FSDP1 keeps its parameters in flat buffers
that `module.to` does not move correctly; FSDP1 has its own permanent CPU offload instead
(`fsdp_config.offload_policy`).

Transfers: the parameters are moved with torch's own `module.to(...)`. FSDP2 overrides `_apply` so
that this moves the local shard of each DTensor parameter (and its gradient) and keeps the
Parameter objects themselves (torch swaps their contents), so the optimizer's references and FSDP's
own bookkeeping stay valid. That copy is blocking, into pageable memory: FSDP2 re-pads an unevenly
sharded parameter on the CPU right after the copy, and with a non-blocking copy that read would race
the transfer. The optimizer's state is ours to move: it goes with `non_blocking=True`, for which
torch allocates the CPU copy in pinned memory (about twice the bandwidth of pageable memory), and one
synchronisation at the end makes the copies complete. Pinned blocks stay cached by torch's host
allocator after the state goes back to the device and are reused by the next offload, so a rank
keeps about one optimizer state's worth of page-locked host memory.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

CPU = torch.device("cpu")


def offload_fsdp_params(module: nn.Module) -> None:
    """Move the local shards of `module`'s FSDP2 parameters, their gradients and the module's buffers to
    CPU memory (see the module docstring for why `module.to` is the right tool and why it blocks)."""
    _require_fsdp2(module)
    module.to(CPU)


def load_fsdp_params(module: nn.Module, device: torch.device | str) -> None:
    """Move what `offload_fsdp_params` parked back to `device` (a no-op for what is there already)."""
    _require_fsdp2(module)
    module.to(torch.device(device))


def free_gradients(module: nn.Module) -> None:
    """Drop every parameter's gradient (what `optimizer.zero_grad()` does, for all of `module`)."""
    for parameter in module.parameters():
        parameter.grad = None


def offload_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Move the optimizer's per-parameter state tensors (e.g. AdamW's exp_avg, exp_avg_sq) to pinned CPU memory.

    A 0-dim state tensor is a counter (AdamW's `step`): torch keeps it where its update kernel wants
    it (on the CPU unless `capturable`/`fused`), so it is left where it is; it is 4 bytes.
    """
    moved_from_gpu = _move_state(optimizer, CPU)
    if moved_from_gpu:
        torch.cuda.synchronize()  # the pinned copies are complete: they may be read or saved now


def load_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move the optimizer's per-parameter state tensors (not the 0-dim counters) to `device`."""
    _move_state(optimizer, torch.device(device))


def _move_state(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Move every state tensor of dimension > 0 to `device`; whether any came from a CUDA device."""
    moved_from_gpu = False
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.device != device:
                moved_from_gpu = moved_from_gpu or value.device.type == "cuda"
                state[key] = value.to(device, non_blocking=True)
    return moved_from_gpu


def _require_fsdp2(module: nn.Module) -> None:
    if isinstance(module, FullyShardedDataParallel):
        raise TypeError("parking parameters on the CPU between phases works for FSDP2 (strategy=fsdp2) only; "
                        "FSDP1 (strategy=fsdp) offloads through its own CPUOffload: "
                        "set fsdp_config.offload_policy=true")


class FSDPOffload:
    """One model's parking rules: what `param_offload` / `optimizer_offload` keep in CPU memory between phases."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, param_offload: bool,
                 optimizer_offload: bool, device: torch.device | str):
        """`device` is the compute device the phases run on. optimizer_offload needs the optimizer."""
        if optimizer_offload and optimizer is None:
            raise ValueError("optimizer_offload=True needs the model's optimizer")
        if param_offload or optimizer_offload:
            _require_fsdp2(module)
        self.module = module
        self.optimizer = optimizer
        self.param_offload = param_offload
        self.optimizer_offload = optimizer_offload
        self.device = torch.device(device)
        self.seconds = {"offload": 0.0, "reload": 0.0}  # time spent moving state, since take_timing()

    def park(self) -> None:
        """Put what the flags name into CPU memory (gradients, with param_offload, are dropped)."""
        started = time.perf_counter()
        if self.param_offload:
            free_gradients(self.module)
            offload_fsdp_params(self.module)
        if self.optimizer_offload:
            offload_optimizer_state(self.optimizer)
        self.seconds["offload"] += self._since(started)

    @property
    def parks_anything(self) -> bool:
        return self.param_offload or self.optimizer_offload

    def load(self, optimizer: bool = False) -> None:
        """Bring the parked parameters (and with `optimizer=True` the parked optimizer state) to the device."""
        started = time.perf_counter()
        if self.param_offload:
            load_fsdp_params(self.module, self.device)
        if optimizer and self.optimizer_offload:
            load_optimizer_state(self.optimizer, self.device)
        self.seconds["reload"] += self._since(started)

    def _since(self, started: float) -> float:
        if self.parks_anything and self.device.type == "cuda":  # the copies are asynchronous
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def take_timing(self, name: str) -> dict[str, float]:
        """timing_s/offload_<name> and timing_s/reload_<name> since the previous call (none when nothing parks)."""
        timing = {f"timing_s/{kind}_{name}": seconds for kind, seconds in self.seconds.items()}
        self.seconds = {"offload": 0.0, "reload": 0.0}
        return timing if self.parks_anything else {}

    @contextlib.contextmanager
    def loaded(self, *, optimizer: bool = False) -> Iterator[None]:
        """The parameters (and with `optimizer=True` the optimizer state) on the device for the body of the
        `with`; parked again afterwards, also when the body raises, so a failed phase leaves the GPU as free
        as a finished one. Without the flags this costs nothing."""
        self.load(optimizer)
        try:
            yield
        finally:
            self.park()
