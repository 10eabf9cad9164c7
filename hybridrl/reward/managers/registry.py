"""Reward managers by name: `reward_model.reward_manager: naive` picks the class registered as "naive"."""
from __future__ import annotations

from typing import Callable

_REWARD_MANAGERS: dict[str, type] = {}


def register_reward_manager(name: str) -> Callable[[type], type]:
    """Class decorator: make the class selectable as `reward_model.reward_manager=<name>`."""
    def decorator(cls: type) -> type:
        if name in _REWARD_MANAGERS and _REWARD_MANAGERS[name] is not cls:
            raise ValueError(f"reward manager {name!r} is already registered as {_REWARD_MANAGERS[name]}")
        _REWARD_MANAGERS[name] = cls
        return cls
    return decorator


def get_reward_manager_cls(name: str) -> type:
    if name not in _REWARD_MANAGERS:
        raise ValueError(f"unknown reward_model.reward_manager {name!r}; registered: {sorted(_REWARD_MANAGERS)}")
    return _REWARD_MANAGERS[name]
