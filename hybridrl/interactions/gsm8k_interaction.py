"""The GSM8K interaction of verl's example: a user who checks the model's last answer against the ground truth.

start_interaction(ground_truth=...) stores the ground truth (from the row's interaction_kwargs); each
generate_response scores the latest assistant message with the strict GSM8K scorer ("#### <answer>"): a
correct answer ends the conversation ("Your response is correct!", score 1), a wrong one asks the model to
try again (score 0), so the model learns from the feedback of its earlier attempts.
"""
from __future__ import annotations

from typing import Any, Optional

from hybridrl.interactions.base import BaseInteraction
from hybridrl.reward.scorers import gsm8k

CORRECT_REPLY = "Your response is correct!"
RETRY_REPLY = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        instance_id = await super().start_interaction(instance_id)
        if ground_truth is None:
            raise ValueError(f"interaction {self.name!r}: start_interaction needs ground_truth "
                             f"(the row's extra_info.interaction_kwargs.ground_truth)")
        self._instance_dict[instance_id] = {"response": "", "ground_truth": str(ground_truth), "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        answers = [message.get("content") or "" for message in messages if message.get("role") == "assistant"]
        self._instance_dict[instance_id]["response"] = answers[-1] if answers else ""
        reward = await self.calculate_score(instance_id)
        self._instance_dict[instance_id]["reward"] = reward
        if reward == 1.0:
            return True, CORRECT_REPLY, reward, {}
        return False, RETRY_REPLY, reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="strict", format_score=0.0,
                                   score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
