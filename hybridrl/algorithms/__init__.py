"""Pure PPO-family math: advantage estimators, policy/value losses, KL, loss aggregation (no I/O, no workers).

The public names of `core_algos` (get_policy_loss_fn, register_adv_est, compute_advantage, ...) are importable
from this package too, as code written against the earlier layout does. They load on first use, so importing a
light submodule (config_checks) does not import torch.
"""
import importlib


def __getattr__(name: str):
    if name.startswith("__"):  # dunder probes (pickle, inspect) must not import torch
        raise AttributeError(name)
    core_algos = importlib.import_module("hybridrl.algorithms.core_algos")
    if name in core_algos.__all__:
        return getattr(core_algos, name)
    raise AttributeError(f"module 'hybridrl.algorithms' has no attribute {name!r}")
