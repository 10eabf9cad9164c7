"""Reward managers by name: `reward_model.reward_manager: naive` picks the class registered as "naive"."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Optional

REWARD_MANAGER_REGISTRY: dict[str, type] = {}


class AbstractRewardManager(ABC):
    """What the trainer needs of a registered manager (verl's base class of the same name, for users who
    subclass it): built as cls(tokenizer=, num_examine=, compute_score=, reward_fn_key=) (reward/managers/loader.py)
    and called as manager(data, return_dict=True) -> {"reward_tensor": (batch, response_length) scores,
    "reward_extra_info": {key: one value per sample}}. The built-in managers (base.RewardManagerBase) keep
    this contract with more machinery (scorer time-outs, failures, examples)."""

    @abstractmethod
    def __init__(self, tokenizer: Any, num_examine: int, compute_score: Optional[Callable],
                 reward_fn_key: str = "data_source", **kwargs: Any):
        """Keep what scoring needs."""

    @abstractmethod
    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        """Score a batch (a DataProto); see the class docstring for what to return."""


def register_reward_manager(name: str) -> Callable[[type], type]:
    """Class decorator: make the class selectable as `reward_model.reward_manager=<name>`."""
    def decorator(cls: type) -> type:
        if name in REWARD_MANAGER_REGISTRY and REWARD_MANAGER_REGISTRY[name] is not cls:
            raise ValueError(f"reward manager {name!r} is already registered as {REWARD_MANAGER_REGISTRY[name]}")
        REWARD_MANAGER_REGISTRY[name] = cls
        return cls
    return decorator


def get_reward_manager_cls(name: str) -> type:
    if name not in REWARD_MANAGER_REGISTRY:
        raise ValueError(f"unknown reward_model.reward_manager {name!r}; registered: {sorted(REWARD_MANAGER_REGISTRY)}")
    return REWARD_MANAGER_REGISTRY[name]
