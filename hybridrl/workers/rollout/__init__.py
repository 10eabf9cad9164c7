"""Rollout engines. Each built-in engine's module is imported when it is selected (BUILTIN_ROLLOUT_MODULES), hf's too:
it needs transformers and peft, which a process that only drives a tensor-parallel group does not import."""
from hybridrl.workers.rollout.base import (BUILTIN_ROLLOUT_MODULES, ROLLOUT_REGISTRY, BaseRollout, build_rollout,
                                           get_rollout_class, load_rollout_class, register_rollout)

__all__ = ["BUILTIN_ROLLOUT_MODULES", "ROLLOUT_REGISTRY", "BaseRollout", "HFRollout", "build_rollout",
           "get_rollout_class", "load_rollout_class", "register_rollout"]


def __getattr__(name: str):
    if name == "HFRollout":
        return get_rollout_class("hf")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
