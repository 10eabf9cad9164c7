"""The switch between trainer mode and rollout mode, one per inference engine.

A worker that both trains and generates (the hybrid engine) wraps every generation in its
sharding manager: entering puts the weights where the engine reads them (rollout mode), leaving
puts them back the way training expects them (trainer mode).

    with sharding_manager:
        output = rollout.generate_sequences(prompts)
"""
from __future__ import annotations


class BaseShardingManager:
    """Enter = rollout mode, exit = trainer mode. Engines subclass this and override both."""

    def __enter__(self) -> "BaseShardingManager":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        return None

    def switch_timing(self) -> dict[str, float]:
        """The last switch's parts as timing_s/<part> metrics; none for a manager without parts worth timing."""
        return {}
