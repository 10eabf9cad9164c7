"""BaseTool: what the agent loop calls on a tool, once per trajectory (verl's interface and signatures).

Lifecycle for one sample: `create` (per-sample state, e.g. the ground truth from
`extra_info.tools_kwargs[name].create_kwargs`), any number of `execute` calls with the model's
arguments, `calc_reward` for the sample's final tool reward, `release`. A tool instance serves
many trajectories at once, keyed by instance_id, so per-trajectory state lives in a dict, not in
attributes. Every method is async: a tool that waits (a subprocess, an HTTP call) must await, not
block, or it stalls every conversation of the event loop.

A verl tool ports by changing `verl.tools` to `hybridrl.tools` in its imports.
"""
from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema]):
        """config: the YAML entry's `config:` mapping; tool_schema: its validated `tool_schema`, or None for a tool
        that describes itself: its get_openai_tool_schema() override gives the schema (a model or a dict)."""
        self.config = config
        self.tool_schema = tool_schema
        if tool_schema is None:
            self.tool_schema = self._own_schema()
        self.name = self.tool_schema.function.name

    def _own_schema(self) -> OpenAIFunctionToolSchema:
        schema = self.get_openai_tool_schema()
        if schema is None:
            raise ValueError(f"{type(self).__name__} has no tool_schema: give one in the YAML entry, or override "
                             f"get_openai_tool_schema() to return it")
        return schema if isinstance(schema, OpenAIFunctionToolSchema) else \
            OpenAIFunctionToolSchema.model_validate(schema)

    def get_openai_tool_schema(self) -> Optional[OpenAIFunctionToolSchema]:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        """Start one trajectory's state. Returns its id (a new uuid when None) and an initial response
        (empty: nothing is added to the conversation)."""
        return (instance_id if instance_id is not None else str(uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run one call. Returns (response for the model, step reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        """The trajectory's tool reward from its state."""
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Drop the trajectory's state."""
