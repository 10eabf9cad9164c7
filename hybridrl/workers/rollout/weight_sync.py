"""The one FSDP -> engine weight stream: what every engine with its own copy of the weights loads.

`iter_rollout_weights(actor_module)` yields (HF parameter name, full tensor) for the FSDP actor,
FSDP1 or FSDP2, the way a plain HF checkpoint names it:
- FSDP2 gathers one unit (decoder layer) at a time in its compute dtype, so a consumer holds at
  most one unit of full tensors (`fsdp_utils.iter_unsharded_parameters`); FSDP1 gathers the
  state dict at once;
- a LoRA policy is sent with its adapters merged into the base weights, under the base names
  (`fsdp_utils.iter_hf_weights`): an engine that knows nothing of LoRA generates from exactly the
  trained policy;
- a tied weight (lm_head.weight tied to the embeddings) is sent once, under its first name: the
  engine ties it itself, as `from_pretrained` does (and it saves vocab x hidden bytes).
Gathering is a collective: every rank iterates to the end, in step. A yielded tensor is only
valid until the iterator advances. Bucketing, casting and transport are the engine's business
(`BaseRollout.update_weights`).
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from hybridrl.models.fsdp_utils import fsdp_root, hf_module, iter_hf_weights


def iter_rollout_weights(actor_module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every weight an inference engine loads; see the module docstring."""
    tied = tied_parameter_names(hf_module(fsdp_root(actor_module)))
    for name, tensor in iter_hf_weights(actor_module):
        if name not in tied:
            yield name, tensor


def tied_parameter_names(model: nn.Module) -> set[str]:
    """Names under which an already-named parameter appears again (e.g. lm_head.weight tied to the embeddings)."""
    seen: set[int] = set()
    tied = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    return tied
