"""The rollout interface and its registry: which engine turns prompts into responses.

`actor_rollout_ref.rollout.name` picks a registered engine; `rollout.custom_cls.path/name` loads a
user's class from a .py file instead (it wins over `name`). Every engine is built the same way,

    rollout_cls(config=<rollout section>, model_config=<actor_rollout_ref.model section>, module=<actor or None>)

where `module` is the FSDP-held actor model (engines that generate from the training weights
use it; engines with their own copy may ignore it). A user class need not subclass BaseRollout,
but must accept those keywords and have `generate_sequences`.

Built-in engines live in their own modules and are imported the first time their name is asked
for, so selecting `hf` never imports sglang or vllm.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any, Callable

from hybridrl.protocol import DataProto
from hybridrl.utils.import_utils import load_extern_object

ROLLOUT_REGISTRY: dict[str, type] = {}

# Built-in engines: name -> module whose import registers it.
BUILTIN_ROLLOUT_MODULES = {
    "hf": "hybridrl.workers.rollout.hf_rollout",
    "sglang": "hybridrl.workers.rollout.sglang_rollout",
    "vllm": "hybridrl.workers.rollout.vllm_rollout",
}


class BaseRollout(ABC):
    """Generates one response per prompt row (the trainer repeats prompts `rollout.n` times beforehand).

    Input batch keys: input_ids, attention_mask, position_ids (prompts, left-padded).
    Output batch keys: prompts, responses (right-padded to exactly `response_length` with the pad
    id), input_ids (prompt + response), attention_mask, position_ids, response_mask (1 up to and
    including the first EOS), and rollout_log_probs when `calculate_log_probs` is on.
    """

    def __init__(self, config: Any, model_config: Any = None, module: Any = None):
        self.config = config
        self.model_config = model_config
        self.module = module

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for `prompts`; meta_info may carry eos_token_id, pad_token_id, validate, do_sample."""


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
    if not isinstance(cls, type) or not callable(getattr(cls, "generate_sequences", None)):
        raise TypeError(f"rollout.custom_cls {custom.name!r} in {custom.path} must be a class with a "
                        f"generate_sequences(prompts) method, got {cls!r}")
    return cls


def build_rollout(rollout_config: Any, model_config: Any = None, module: Any = None):
    """Instantiate the configured rollout engine."""
    return load_rollout_class(rollout_config)(config=rollout_config, model_config=model_config, module=module)
