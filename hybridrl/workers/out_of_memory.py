"""A GPU out-of-memory in a training-side pass (an update, a log-prob or value pass), turned into an error that says
which micro-batch asked for the memory and which keys make the pass smaller.

torch's own message reaches the driver through Ray with the allocator's numbers, but not the micro-batch that ran
out nor the settings that size it. The 1.5B recipe's first run on an H100 (2026-12-06) stopped that way in its
first update; what fixed it, a smaller token budget per micro-batch and activation checkpointing, is what this
error names. The error is still a `torch.OutOfMemoryError` (a subclass), with torch's as its cause.
"""
from __future__ import annotations

import torch

GiB = 1024 ** 3


class TrainingMemoryError(torch.OutOfMemoryError):
    """Out of GPU memory in a training-side pass: the message holds the micro-batch and the keys to change."""


def memory_remedies(section: str, model: str, *, token_budget: tuple[str, int | None],
                    row_budget: tuple[str, int | None], gradient_checkpointing: bool | None = None,
                    fused_kernels: bool | None = None) -> tuple[str, ...]:
    """The keys that make a pass need less memory, each with its value now.

    section: the config section of the pass's micro-batch sizes (e.g. actor_rollout_ref.actor); model: its model
    section. token_budget: (key, value) of the token budget per micro-batch, value None without dynamic batch
    size, when row_budget (rows per micro-batch) sizes the micro-batches instead. gradient_checkpointing / fused
    kernels: the model's settings, None where they do not apply (a forward without gradients keeps no activations
    to recompute; the critic has no vocabulary-sized logits).
    """
    key, value = token_budget if token_budget[1] is not None else row_budget
    remedies = [f"lower {section}.{key} (now {value})"]
    if gradient_checkpointing is False:
        remedies.append(f"set {model}.enable_gradient_checkpointing=true (activations recomputed in the backward "
                        f"instead of kept)")
    if fused_kernels is False:
        remedies.append(f"set {model}.use_fused_kernels=true (log-probs without the whole vocabulary's logits)")
    return tuple(remedies)


def training_memory_error(pass_name: str, micro_batch: dict[str, torch.Tensor], device: torch.device,
                          remedies: tuple[str, ...]) -> TrainingMemoryError:
    """The error for `pass_name` running out of memory on `micro_batch`: its rows and tokens, the allocator's
    numbers on `device` at that moment (CUDA only), and the remedies."""
    rows = len(micro_batch["input_ids"])
    mask = micro_batch.get("attention_mask")
    tokens = int(mask.sum()) if mask is not None else micro_batch["input_ids"].numel()
    return TrainingMemoryError(
        f"{pass_name} ran out of GPU memory in a micro-batch of {rows} sequence{'s' * (rows != 1)} and {tokens} tokens"
        f"{allocator_report(device)}. Make room: {'; or '.join(remedies)}. torch's message is the cause above.")


def allocator_report(device: torch.device) -> str:
    """', with X GiB allocated, ...' on a CUDA device; '' elsewhere (nothing there runs out this way)."""
    if device.type != "cuda":
        return ""
    free, total = torch.cuda.mem_get_info(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    return (f", with {allocated / GiB:.2f} GiB allocated by this process, {(reserved - allocated) / GiB:.2f} GiB "
            f"reserved but unallocated, {free / GiB:.2f} of {total / GiB:.2f} GiB free")
