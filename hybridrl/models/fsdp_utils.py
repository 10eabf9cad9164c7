"""Build a trainable, sharded HF model: load from a local directory, shard with FSDP2 (or FSDP1), optimise.

Every role that holds weights (actor, reference, critic, rollout) goes through these functions, so the
CPU path (gloo, fp32) and the GPU path (nccl, bf16 compute with fp32 master weights and fp32
gradient reduction) differ only in the device and the mixed-precision policy chosen here.

Sharding unit: each decoder layer (the classes HF lists in `model._no_split_modules`), then the
root, which keeps the embeddings, final norm and head (so tied embeddings stay one parameter).

FSDP1 (`strategy=fsdp`) works on CPU with gloo in torch 2.13 for training, log-probs and HF
generation (inside `summon_full_params`); the one thing that fails there is a full state dict
gathered with `cpu_offload=True` (a segfault), which is why the gather below never offloads.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (CPUOffload, CPUOffloadPolicy, FSDPModule, FullyShardedDataParallel, MixedPrecision,
                                    MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy, fully_shard)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

STRATEGIES = ("fsdp2", "fsdp")


def plain(value: Any) -> Any:
    """A plain-Python copy of a config value (mappings -> dict, sequences -> list), e.g. `override_config`.

    Works for dataclass-config dicts and for OmegaConf containers alike (both are Mapping/Sequence).
    """
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(item) for item in value]
    return value


def load_hf_model(model_path: str, *, value_head: bool = False, trust_remote_code: bool = False,
                  override_config: Mapping | None = None, dtype: torch.dtype = torch.float32,
                  gradient_checkpointing: bool = False, init_seed: int = 0,
                  attn_implementation: str = "sdpa") -> nn.Module:
    """The HF model in `model_path` (a local directory), on the CPU, in `dtype`.

    value_head=False: AutoModelForCausalLM (actor, reference, rollout).
    value_head=True: AutoModelForTokenClassification with one label, the critic: the causal LM
    backbone plus a freshly initialised linear value head. Its dropout is set to 0 so values are
    deterministic. Weights missing from the checkpoint (the value head) are drawn from a private RNG
    seeded with `init_seed`: every rank builds the same ones, whatever its global RNG did before,
    which FSDP needs (each rank keeps its own shard of what it built). attn_implementation: see
    models/attention.py (`attention_implementation` picks it from the device and the batch layout).
    """
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    overrides = plain(override_config or {})
    if value_head:
        overrides = {"num_labels": 1, "classifier_dropout": 0.0, **overrides}
    for key, value in overrides.items():
        setattr(config, key, value)
    model_cls = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        model = model_cls.from_pretrained(model_path, config=config, dtype=dtype, trust_remote_code=trust_remote_code,
                                          attn_implementation=attn_implementation)
    if gradient_checkpointing:
        # transformers 5.x renamed it (the old name warns and goes in v6); older releases have only the old name
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def apply_liger(model: nn.Module) -> None:
    """Swap in liger-kernel's fused Triton kernels (RMSNorm, RoPE, SwiGLU, ...) in place. GPU only: the
    config validation refuses `model.use_liger` without CUDA or without the liger-kernel package."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model)


def apply_lora(model: nn.Module, *, lora_rank: int, lora_alpha: int, target_modules, exclude_modules=None,
               adapter_path: str | None = None, value_head: bool = False) -> nn.Module:
    """Wrap `model` in peft LoRA adapters (before sharding); only the adapters stay trainable.

    A fresh adapter starts with B = 0 (peft's default), so the wrapped model computes exactly what the
    base model does until the first update. `adapter_path` loads a saved peft adapter instead (trainable);
    its rank must be `lora_rank`. The base model stays reachable unchanged under the adapters:
    `model.disable_adapter()` is the reference policy, without a second copy of the weights.
    value_head (the critic): the freshly initialised value head gets no adapter but is trained in
    full (peft's modules_to_save), since a frozen random head could not learn values.
    """
    from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model  # here: most runs train no adapter

    if adapter_path is not None:
        saved_rank = PeftConfig.from_pretrained(adapter_path).r
        if saved_rank != lora_rank:
            raise ValueError(f"model.lora_adapter_path={adapter_path} holds a rank-{saved_rank} adapter, but "
                             f"model.lora_rank={lora_rank}")
        return PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    task_type = "CAUSAL_LM"
    if value_head:
        if exclude_modules is not None:
            raise ValueError(f"apply_lora: value_head=True excludes the value head itself; got exclude_modules="
                             f"{exclude_modules!r} as well")
        exclude_modules, task_type = ["score" if hasattr(model, "score") else "classifier"], "TOKEN_CLS"
    config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=plain(target_modules),
                        exclude_modules=plain(exclude_modules), bias="none", task_type=task_type)
    return get_peft_model(model, config)


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The module classes to shard one by one: HF's `_no_split_modules` (e.g. Qwen2DecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(module) for module in model.modules() if type(module).__name__ in names}
    if not classes:
        raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules "
                         f"({sorted(names)}); cannot choose FSDP units")
    return classes


def shard_model(model: nn.Module, *, strategy: str, device: str, mixed_precision: bool,
                reshard_after_forward: bool = True, cpu_offload: bool = False,
                forward_prefetch: bool = False) -> nn.Module:
    """Shard `model` over all ranks of the default process group; returns the module to use from now on.

    strategy="fsdp2": `fully_shard` on every decoder layer, then the root; the model keeps its class
    and parameter names (its parameters become DTensors). strategy="fsdp": FSDP1 with the same units,
    `use_orig_params=True`; the returned object is the FullyShardedDataParallel wrapper.
    mixed_precision (GPU): parameters are gathered and computed in bf16, gradients reduced in fp32,
    the sharded master copy stays in the dtype it was loaded in.
    cpu_offload (GPU): the sharded parameters, gradients and optimizer state live in host memory
    (FSDP2 CPUOffloadPolicy / FSDP1 CPUOffload); the optimizer step then runs on the CPU.
    A peft (LoRA) model under FSDP2 keeps its wrapper unsharded: the FSDP root is the HF model inside
    (see `fsdp_root`), because HF generate on the wrapper runs the inner model's forward, and FSDP2
    needs every forward to enter through its root.
    forward_prefetch (fsdp_config.forward_prefetch): each decoder layer's all-gather is issued before the
    previous layer's forward has finished, so communication overlaps compute (more memory: two layers
    gathered at once). FSDP1: its forward_prefetch flag; FSDP2: each layer names the next one with
    `set_modules_to_forward_prefetch`. The numbers do not change, only when the gathers happen.
    """
    if cpu_offload and device != "cuda":
        raise ValueError("cpu_offload only applies to a GPU run: on the CPU the parameters are in host memory already")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {list(STRATEGIES)}, got {strategy!r}")
    layer_classes = decoder_layer_classes(model)
    if strategy == "fsdp2":
        mesh = init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if mixed_precision else MixedPrecisionPolicy())
        shard = functools.partial(fully_shard, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
        layers = [module for module in model.modules() if type(module) in layer_classes]
        for layer in layers:
            shard(layer)
        if forward_prefetch:
            for layer, next_layer in zip(layers, layers[1:]):
                layer.set_modules_to_forward_prefetch([next_layer])
        # The root is left to FSDP's own rule (reshard_after_forward=None): it keeps its parameters
        # (embeddings, head) after forward, since backward needs them right away.
        shard(fsdp_root(model), reshard_after_forward=None)
        return model
    # cast_forward_inputs on every unit: a layer run outside the root's forward (HF generate on the
    # inner model, see workers/rollout/hf_rollout.py) must still get bf16 inputs for its bf16 weights.
    precision = (MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32,
                                cast_forward_inputs=True) if mixed_precision else None)
    device_id = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return FullyShardedDataParallel(
        model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes),
        sharding_strategy=ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=precision, device_id=device_id, use_orig_params=True, forward_prefetch=forward_prefetch,
        cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None)


def fsdp_root(module: nn.Module) -> nn.Module:
    """The module FSDP treats as its root, which generation runs and gathers: `module` itself, or under
    FSDP2 with LoRA the HF model inside the peft wrapper (it carries the adapters, so it is the policy)."""
    return module.get_base_model() if is_peft_model(module) else module


def is_peft_model(module: nn.Module) -> bool:
    """Whether `module` is a peft wrapper. A process that never imported peft holds none: peft is imported by
    `apply_lora` alone, since its import costs every worker process about a second of CPU."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def hf_module(module: nn.Module) -> nn.Module:
    """The HF model inside `module` (FSDP1 wraps it; FSDP2 keeps the model itself)."""
    return module.module if isinstance(module, FullyShardedDataParallel) else module


def build_optimizer(module: nn.Module, optim_config) -> torch.optim.AdamW:
    """AdamW over the (sharded) parameters with `optim.lr`, `optim.betas`, `optim.weight_decay`.

    Frozen parameters (the base model under LoRA) never get a gradient, and AdamW skips those entirely:
    no state, no weight decay."""
    betas = tuple(optim_config.betas)
    if len(betas) != 2:
        raise ValueError(f"optim.betas must hold two floats, got {list(optim_config.betas)}")
    return torch.optim.AdamW(module.parameters(), lr=optim_config.lr, betas=betas,
                             weight_decay=optim_config.weight_decay)


def warmup_steps(optim_config, total_training_steps: int | None) -> int:
    """`lr_warmup_steps` when > 0, else `lr_warmup_steps_ratio * total_training_steps` (rounded down)."""
    if optim_config.lr_warmup_steps > 0:
        return int(optim_config.lr_warmup_steps)
    if optim_config.lr_warmup_steps_ratio > 0 and not total_training_steps:
        raise ValueError(f"optim.lr_warmup_steps_ratio={optim_config.lr_warmup_steps_ratio} needs the run length "
                         f"(total_training_steps > 0, which the trainer passes), got {total_training_steps}")
    return int(optim_config.lr_warmup_steps_ratio * (total_training_steps or 0))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim_config,
                       total_training_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule `optim.warmup_style` names, stepped once per training step.

    constant: linear warmup from 0, then `lr`. cosine: linear warmup, then a cosine decay
    (`num_cycles`) over `total_training_steps` down to `min_lr_ratio * lr`. `total_training_steps` is the
    run length the trainer computed (an argument, never written into the validated config); None where
    the caller has no run (a worker built outside the trainer), fine for a schedule that does not need it.
    """
    # here: transformers.optimization imports its Trainer's helpers and peft, which a process building no optimizer
    # schedule (a reference model, a test's rank) does without
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    warmup = warmup_steps(optim_config, total_training_steps)
    if optim_config.warmup_style == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if optim_config.warmup_style == "cosine":
        if not total_training_steps or total_training_steps <= 0:
            raise ValueError(f"optim.warmup_style=cosine needs the run length (total_training_steps > 0, which the "
                             f"trainer passes), got {total_training_steps}")
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=warmup, num_training_steps=total_training_steps,
            num_cycles=optim_config.num_cycles, min_lr_rate=optim_config.min_lr_ratio)
    raise ValueError(f"optim.warmup_style must be 'constant' or 'cosine', got {optim_config.warmup_style!r}")


def clip_grad_norm(module: nn.Module, max_norm: float) -> float:
    """Clip the gradients of the sharded `module` to a global L2 norm of `max_norm`; returns the norm before.

    The norm is over the whole model (all ranks), so every rank returns the same number.
    """
    if isinstance(module, FullyShardedDataParallel):
        return float(module.clip_grad_norm_(max_norm))
    total_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    return float(total_norm)


def iter_full_state_dict(module: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, full unsharded tensor in `dtype`) for every entry of the state dict.

    FSDP2 gathers one tensor at a time, so a consumer (a weight sync in buckets) never holds more than
    it asks for; FSDP1 can only gather the whole state dict at once. Gathering is a collective:
    every rank must run the iterator to its end, in step, while the model is in trainer mode
    (not inside a rollout context). Tied weights appear under both names, as in `state_dict()`.
    """
    if isinstance(module, FullyShardedDataParallel):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        entries = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True)).items()
    else:
        entries = module.state_dict().items()
    for name, value in entries:
        full = value.full_tensor() if isinstance(value, DTensor) else value
        yield name, full if dtype is None else full.to(dtype)



def iter_unsharded_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every entry of the state dict, gathered the way FSDP2 gathers for compute.

    The fast path for weight sync: each FSDP2 unit (a decoder layer, then the root's embeddings /
    norm / head) is unsharded with FSDP2's own batched all-gather, in its compute dtype (bf16 under
    mixed precision: half the bytes of gathering fp32 master weights, and no cast afterwards), its
    parameters are yielded, and the unit is resharded before the next one, so at most one unit is
    ever gathered. A yielded tensor is only valid until the iterator advances: copy it at once.
    The tensors are in the compute dtype, not necessarily fp32. FSDP1 (and an unsharded module)
    falls back to `iter_full_state_dict`. Tied weights appear under both names, as in `state_dict()`.
    Collective: every rank runs the iterator to its end, in step, in trainer mode.
    """
    units = [(name, unit) for name, unit in module.named_modules() if isinstance(unit, FSDPModule)]
    if not units:  # FSDP1 or not sharded (a peft wrapper around FSDP2 units does count as FSDP2)
        yield from iter_full_state_dict(module)
        return
    for unit_name, unit in units:
        unit.unshard()
        for name, parameter in _own_parameters(unit, prefix=f"{unit_name}." if unit_name else ""):
            yield name, parameter.detach()
        unit.reshard()
    for module_name, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set:  # e.g. rotary inv_freq is not in the state dict
                yield f"{module_name}.{name}" if module_name else name, buffer


def _own_parameters(unit: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters of `unit` that are not inside a nested FSDP2 unit (which gathers them itself), tied ones
    under every name."""
    for name, parameter in unit.named_parameters(recurse=False, remove_duplicate=False):
        yield prefix + name, parameter
    for child_name, child in unit.named_children():
        if not isinstance(child, FSDPModule):
            yield from _own_parameters(child, f"{prefix}{child_name}.")


PEFT_PREFIX = "base_model.model."


def iter_hf_weights(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_unsharded_parameters` as a plain HF checkpoint names it: what an inference engine loads.

    Without LoRA that is the stream itself. Under a peft LoRA wrapper each adapted layer is sent
    merged, W + B·A·scaling (peft's own `get_delta_weight`, computed while its FSDP unit is gathered),
    under the base layer's HF name; the adapter tensors themselves are not sent, and the peft prefix
    is stripped. So an engine that knows nothing of LoRA generates from exactly the trained policy.
    """
    if not is_peft_model(module):
        yield from iter_unsharded_parameters(module)
        return
    adapter = module.active_adapter
    adapted = {name: layer for name, layer in module.named_modules() if hasattr(layer, "get_delta_weight")}
    for name, tensor in iter_unsharded_parameters(module):
        if ".lora_" in name:  # lora_A / lora_B / lora_embedding_*: folded into their base weight below
            continue
        layer_name, _, leaf = name.rpartition(".base_layer.")
        if layer_name in adapted:
            if leaf == "weight":
                tensor = tensor + adapted[layer_name].get_delta_weight(adapter).to(tensor.dtype)
            name = f"{layer_name}.{leaf}"
        yield name.removeprefix(PEFT_PREFIX), tensor
