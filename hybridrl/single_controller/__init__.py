"""How work is dispatched: a Worker per rank, @register to say how a call spreads over the ranks,
and Ray resource pools and worker groups (hybridrl.single_controller.ray) to run them.

The names below load on first use: the driver imports `single_controller.local_cluster` before anything needs
torch, and a config error or `--cfg job` then answers without importing it."""
import importlib

_WHERE = {"Dispatch": "decorator", "Execute": "decorator", "register": "decorator", "Worker": "worker"}

__all__ = ["Dispatch", "Execute", "Worker", "register"]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
