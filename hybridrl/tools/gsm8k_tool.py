"""The GSM8K answer tool of verl's example: the model submits an answer, the tool scores it.

create(ground_truth=...) stores the ground truth (from the row's tools_kwargs create_kwargs);
execute({"answer": "72"}) scores "#### 72" with the flexible GSM8K scorer, replies with the parsed
answer and score, and gives a step reward of 0 when the score improved on the previous submission,
-0.05 otherwise (verl's penalty for non-improving resubmissions); calc_reward is the latest score.
"""
from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from hybridrl.tools.base_tool import BaseTool
from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from hybridrl.reward.scorers import gsm8k

NON_IMPROVING_PENALTY = -0.05


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._instance_dict: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:  # verl also accepts it nested under create_kwargs
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError(f"{self.name}.create needs ground_truth (extra_info.tools_kwargs."
                             f"{self.name}.create_kwargs.ground_truth)")
        self._instance_dict[instance_id] = {"response": "", "ground_truth": str(ground_truth), "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs) -> tuple[ToolResponse, float, dict]:
        if not isinstance(parameters, dict) or "answer" not in parameters:
            return ToolResponse(text=f"Error: {self.name} expects arguments {{\"answer\": \"<number>\"}}, "
                                     f"got {parameters!r}"), NON_IMPROVING_PENALTY, {"malformed_parameters": 1}
        answer = str(parameters["answer"])
        state = self._instance_dict[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else NON_IMPROVING_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed {answer=} {reward=}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k.compute_score(state["response"], state["ground_truth"], method="flexible",
                                   format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instance_dict.pop(instance_id, None)
