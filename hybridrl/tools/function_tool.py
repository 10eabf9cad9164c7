"""A tool that is one plain function, without verl's create/execute/release life cycle (verl's FunctionTool, which
its ToolAgentLoop calls directly since verl 0.8).

hybridrl builds no function tools from config (verl's `multi_turn.function_tool_path` is not a key here: the tool
YAML's BaseTool classes are the one way to declare tools), but a verl loop tests every tool against this class and
turns whatever a function returned into the (response, reward, metrics) a BaseTool's execute returns.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


@dataclass
class FunctionTool:
    """`fn` under the name and schema the model calls it by; `is_async`: fn is a coroutine function."""
    name: str
    fn: Callable[..., Any]
    tool_schema: OpenAIFunctionToolSchema
    is_async: bool = False

    async def call(self, arguments: dict[str, Any]) -> Any:
        """fn(**arguments); a blocking fn runs off the event loop."""
        if self.is_async:
            return await self.fn(**arguments)
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self.fn(**arguments))


def normalize_function_tool_return(returned: Any) -> tuple[ToolResponse, float, dict]:
    """(response, reward, metrics) from what a function returned: a ToolResponse or a string (its text), a dict
    (its JSON), or a tuple (response[, reward[, metrics]]) whose None reward is 0.0 and None metrics {}; anything
    else by its str(). A tuple of another length is an authoring error and raises TypeError."""
    if isinstance(returned, tuple):
        if not 1 <= len(returned) <= 3:
            raise TypeError(f"a function tool's tuple must be (response,), (response, reward) or (response, reward, "
                            f"metrics), got {len(returned)} items: {returned!r}")
        response, reward, metrics = (*returned, None, None)[:3]
        return (_response(response), 0.0 if reward is None else float(reward),
                {} if metrics is None else dict(metrics))
    return _response(returned), 0.0, {}


def _response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if isinstance(value, dict):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=value if isinstance(value, str) else str(value))
