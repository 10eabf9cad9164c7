"""Run one tool call so that nothing the tool does can stop the rollout step.

`run_tool_call` is what the agent loop awaits for each parsed call: the tool's own exceptions,
a hang past the timeout, and a malformed return value all become an error response for the model
("Error: ...") plus an `error` string for the loop's counters; the traceback is logged once, here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple, Optional

from hybridrl.tools.base_tool import BaseTool
from hybridrl.tools.schemas import ToolResponse

logger = logging.getLogger(__name__)


class ToolCallResult(NamedTuple):
    """Unpacks as (response, reward, metrics, error); error is None when the call succeeded."""
    response: ToolResponse
    reward: float
    metrics: dict[str, Any]
    error: Optional[str]


async def run_tool_call(tool: BaseTool, instance_id: str, parameters: dict[str, Any], timeout_s: Optional[float],
                        **kwargs) -> ToolCallResult:
    """`await tool.execute(instance_id, parameters, **kwargs)` bounded by timeout_s (None: no bound).

    metrics always hold tool_latency_s, tool_error (0/1) and tool_timeout (0/1), plus the tool's own.
    A timeout cancels the call (the sandbox kills its processes on cancellation)."""
    started = time.monotonic()
    try:
        returned = await asyncio.wait_for(tool.execute(instance_id, parameters, **kwargs), timeout=timeout_s)
        response, reward, tool_metrics = _check_returned(tool, returned)
    except asyncio.TimeoutError:
        error = f"tool {tool.name!r} timed out after {timeout_s} s"
        logger.error("%s (instance %s, parameters %.200r)", error, instance_id, parameters)
        return _failure(error, started, timed_out=True)
    except Exception as exception:  # noqa: BLE001 - any tool fault costs only this call
        error = f"tool {tool.name!r} raised {type(exception).__name__}: {exception}"
        logger.error("%s (instance %s, parameters %.200r)", error, instance_id, parameters, exc_info=True)
        return _failure(error, started, timed_out=False)
    metrics = {**tool_metrics, "tool_latency_s": time.monotonic() - started, "tool_error": 0, "tool_timeout": 0}
    return ToolCallResult(response, reward, metrics, None)


def _failure(error: str, started: float, timed_out: bool) -> ToolCallResult:
    metrics = {"tool_latency_s": time.monotonic() - started, "tool_error": 1, "tool_timeout": int(timed_out)}
    return ToolCallResult(ToolResponse(text=f"Error: {error}"), 0.0, metrics, error)


def _check_returned(tool: BaseTool, returned: Any) -> tuple[ToolResponse, float, dict]:
    """verl tools return (ToolResponse | str | dict, float | None, dict | None); anything else is a fault."""
    if not (isinstance(returned, tuple) and len(returned) == 3):
        raise TypeError(f"execute returned {returned!r}, expected (ToolResponse, reward, metrics)")
    response, reward, metrics = returned
    if isinstance(response, str):
        response = ToolResponse(text=response)
    elif isinstance(response, dict):
        response = ToolResponse(**response)
    elif not isinstance(response, ToolResponse):
        raise TypeError(f"execute returned response {response!r}, expected a ToolResponse")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise TypeError(f"execute returned reward {reward!r}, expected a number or None")
    if metrics is not None and not isinstance(metrics, dict):
        raise TypeError(f"execute returned metrics {metrics!r}, expected a dict or None")
    return response, float(reward or 0.0), dict(metrics or {})
