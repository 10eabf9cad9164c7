"""Rollout engines. `hf` is always registered; sglang and vllm are imported only when selected."""
from hybridrl.workers.rollout.base import (BUILTIN_ROLLOUT_MODULES, ROLLOUT_REGISTRY, BaseRollout, build_rollout,
                                           get_rollout_class, load_rollout_class, register_rollout)
from hybridrl.workers.rollout.hf_rollout import HFRollout

__all__ = ["BUILTIN_ROLLOUT_MODULES", "ROLLOUT_REGISTRY", "BaseRollout", "HFRollout", "build_rollout",
           "get_rollout_class", "load_rollout_class", "register_rollout"]
