"""BaseInteraction: what the tool_agent loop calls on an interaction, once per trajectory (verl's interface).

Lifecycle for one sample: `start_interaction` (per-sample state from the row's interaction_kwargs, e.g. the
ground truth), then, after each assistant turn that calls no tool, `generate_response` with the conversation so far:
it returns (should the conversation end, the user's reply, this turn's score, extra data). The loop appends the
reply as a user message (not trained on: response_mask 0) and generates again unless told to end;
`finalize_interaction` drops the state. One instance serves many trajectories at once, keyed by instance_id.
"""
from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4


class BaseInteraction:
    def __init__(self, config: dict[str, Any]):
        """config: the YAML entry's `config:` mapping, with `name` set by the registry."""
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: Optional[str] = None, **kwargs) -> str:
        """Start one trajectory's state; returns its id (a new uuid when None)."""
        return instance_id if instance_id is not None else str(uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        """(should_terminate_sequence, the user's reply, this turn's score, extra data)."""
        return False, "Your current result seems acceptable.", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        """The trajectory's score from its state."""
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        """Drop the trajectory's state."""
