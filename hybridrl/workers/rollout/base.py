"""The rollout interface and its registry: which engine turns prompts into responses.

`actor_rollout_ref.rollout.name` picks a registered engine; `rollout.custom_cls.path/name` loads a
user's class from a .py file instead (it wins over `name`). Every engine is built the same way,

    rollout_cls(config=<rollout section>, model_config=<the policy's ModelSpec>, module=<actor or None>)

`model_config` is the policy model the controller resolved (models/spec.py; verl's name for it, and like
verl's HFModelConfig it has `local_path`); `module` is the FSDP-held actor model (engines that generate from
the training weights use it; engines with their own copy may ignore it). A user class need not subclass
BaseRollout, but must have its four methods (the lifecycle contract below) and accept those keywords.

The lifecycle contract (verl's names) is how the worker moves one rank between trainer mode and
rollout mode; the controller decides when (worker methods `rollout_mode` / `trainer_mode`, see
workers/rollout/mode_switch.py for the order):

    resume(("weights",))            give the weights their memory back
    update_weights(named_tensors)   load the trainer's current weights (skipped when the engine
                                    already holds them, or when it shares the trainer's module)
    resume(("kv_cache",))           give the KV cache (and whatever else generation needs) its memory
    generate_sequences(prompts)     any number of times
    release(("kv_cache", "weights")) give the memory back to the trainer

Built-in engines live in their own modules and are imported the first time their name is asked
for, so selecting `hf` never imports sglang or vllm.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Iterable

import torch

from hybridrl.protocol import DataProto
from hybridrl.utils.import_utils import load_extern_object

ROLLOUT_REGISTRY: dict[str, type] = {}

# Built-in engines: name -> module whose import registers it.
BUILTIN_ROLLOUT_MODULES = {
    "hf": "hybridrl.workers.rollout.hf_rollout",
    "sglang": "hybridrl.workers.rollout.sglang_rollout",
    "vllm": "hybridrl.workers.rollout.vllm_rollout",
}


LIFECYCLE_METHODS = ("resume", "update_weights", "release", "generate_sequences")
MEMORY_TAGS = ("weights", "kv_cache")


class BaseRollout(ABC):
    """Generates one response per prompt row (the trainer repeats prompts `rollout.n` times beforehand).

    Input batch keys: input_ids, attention_mask, position_ids (prompts, left-padded).
    Output batch keys: prompts, responses (right-padded to exactly `response_length` with the pad
    id), input_ids (prompt + response), attention_mask, position_ids, response_mask (1 up to and
    including the first EOS), and rollout_log_probs when `calculate_log_probs` is on; build them
    with `batch_layout.to_batch_layout`.

    Memory tags are "weights" and "kv_cache" (verl's). An engine that has nothing to free for a tag
    ignores it. Every method is called on every rank in step (weight gathering is a collective).
    """

    shares_trainer_weights: ClassVar[bool] = False
    """True: the engine generates from the trainer's own module (the `module` it was built with), so no copy
    of the weights is ever pushed: `update_weights` is not called, and `resume(("weights",))` is where the
    engine makes the trainer's (sharded) weights usable for generation (the hf engine gathers them once)."""

    weights_survive_release: ClassVar[bool] = False
    """True: `release(("weights",))` keeps the weight contents (e.g. moves them off the device), so after a
    resume with no new weights version in between the push is skipped. False (SGLang's memory saver drops
    them): every resume of the weights is followed by a push. An engine may make it a property."""

    allocator_bytes: int = 0
    """Bytes the engine holds in this process's torch allocator for its whole life: vLLM's weight and KV-cache
    tensors stay allocated (their memory unmapped) while it sleeps, so torch's allocated counts and peaks include
    them, and the trainer's own are those less this. 0 for an engine in other processes (sglang) or on the trainer's
    own weights (hf)."""

    def __init__(self, config: Any, model_config: Any = None, module: Any = None):
        self.config = config
        self.model_config = model_config
        self.module = module

    def resume(self, tags: tuple[str, ...]) -> None:
        """Give the memory named by `tags` back to the engine (trainer mode -> rollout mode). Default: nothing
        to do (an engine that never releases memory)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's weights: (HF parameter name, full tensor) pairs from
        `weight_sync.iter_rollout_weights` (LoRA merged, a tied weight under its first name only). A tensor is
        only valid until the iterator advances (its FSDP unit is resharded): copy it at once. The iterator must
        be consumed to its end on every rank (it gathers). Bucketing and dtype casts are the engine's business."""
        raise NotImplementedError(f"{type(self).__name__} keeps its own copy of the weights "
                                  f"(shares_trainer_weights=False) but does not implement update_weights")

    def release(self, tags: tuple[str, ...]) -> None:
        """Give the memory named by `tags` back to the trainer (rollout mode -> trainer mode). Default: nothing."""

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for `prompts`; meta_info may carry eos_token_id, pad_token_id, validate, do_sample."""

    def take_metrics(self) -> dict[str, float]:
        """Engine-specific metrics of the last switch (e.g. sglang's timing_s/flush_cache), then forgotten."""
        return {}


def register_rollout(name: str) -> Callable[[type], type]:
    """Class decorator: make the class selectable as `rollout.name=<name>`."""
    def decorator(cls: type) -> type:
        existing = ROLLOUT_REGISTRY.get(name)
        if existing is not None and existing is not cls:
            raise ValueError(f"rollout {name!r} is already registered to {existing.__module__}.{existing.__qualname__}")
        ROLLOUT_REGISTRY[name] = cls
        return cls
    return decorator


def get_rollout_class(name: str) -> type:
    """The class registered as `name`, importing a built-in engine's module on first use."""
    if name not in ROLLOUT_REGISTRY and name in BUILTIN_ROLLOUT_MODULES:
        module_name = BUILTIN_ROLLOUT_MODULES[name]
        try:
            importlib.import_module(module_name)
        except ImportError as err:
            raise ImportError(f"rollout.name={name!r} needs {module_name}, which failed to import: {err}") from err
    if name not in ROLLOUT_REGISTRY:
        known = sorted(set(ROLLOUT_REGISTRY) | set(BUILTIN_ROLLOUT_MODULES))
        raise ValueError(f"rollout.name={name!r} is not a registered rollout; known: {known} "
                         f"(or set rollout.custom_cls.path/name)")
    return ROLLOUT_REGISTRY[name]


def load_rollout_class(rollout_config: Any) -> type:
    """`rollout.custom_cls.path/name` when set, else the registered `rollout.name`."""
    custom = rollout_config.custom_cls
    if custom.path is None and custom.name is None:
        return get_rollout_class(rollout_config.name)
    if custom.path is None or custom.name is None:
        raise ValueError(f"rollout.custom_cls needs both path and name, got path={custom.path!r} name={custom.name!r}")
    cls = load_extern_object(custom.path, custom.name)
    if not isinstance(cls, type):
        raise TypeError(f"rollout.custom_cls {custom.name!r} in {custom.path} must be a class, got {cls!r}")
    missing = [name for name in LIFECYCLE_METHODS if not callable(getattr(cls, name, None))]
    if missing:
        raise TypeError(f"rollout.custom_cls {custom.name!r} in {custom.path} must have the rollout lifecycle methods "
                        f"{list(LIFECYCLE_METHODS)} (subclass hybridrl.workers.rollout.BaseRollout); missing {missing}")
    return cls


def build_rollout(rollout_config: Any, model_config: Any = None, module: Any = None, engine_load: Any = None):
    """Instantiate the configured rollout engine for `model_config` (the policy's ModelSpec); with
    tensor_model_parallel_size k > 1 and an engine that can span GPUs (`spans_gpus`: sglang), one engine per k ranks,
    which every rank of the group drives (rollout/tensor_parallel.py). hf generates from the FSDP module itself and ignores k. engine_load: the
    schedule's peak sequences on one engine (rollout/engine_load.py), given to engines that size for it
    (`sized_for_load`: sglang, vllm)."""
    cls = load_rollout_class(rollout_config)
    sizing = {"engine_load": engine_load} if getattr(cls, "sized_for_load", False) else {}
    if rollout_config.tensor_model_parallel_size == 1 or not getattr(cls, "spans_gpus", False):
        return cls(config=rollout_config, model_config=model_config, module=module, **sizing)
    from hybridrl.workers.rollout.tensor_parallel import TensorParallelRollout

    return TensorParallelRollout(rollout_config, lambda gpu_ids: cls(config=rollout_config, model_config=model_config,
                                                                     module=module, engine_gpus=gpu_ids, **sizing),
                                 model_path=model_config.path)
