"""Tools for multi-turn rollouts, shaped like verl's `verl.tools` (a verl tool ports by changing imports).

    from hybridrl.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse
    tools = initialize_tools_from_config("tool_config.yaml")
    result = await run_tool_call(tool, instance_id, arguments, timeout_s=30)   # never raises

Modules: schemas (pydantic models), base_tool, utils/tool_registry (YAML loading), tool_call (the
fault-containing wrapper), tools_kwargs (per-sample arguments), utils/truncate; built-in tools:
gsm8k_tool.Gsm8kTool, code_interpreter_tool.CodeInterpreterTool (on sandbox.py).
"""
from hybridrl.tools.base_tool import BaseTool
from hybridrl.tools.schemas import (OpenAIFunctionCallSchema, OpenAIFunctionParametersSchema,
                                    OpenAIFunctionParsedSchema, OpenAIFunctionPropertySchema, OpenAIFunctionSchema,
                                    OpenAIFunctionToolCall, OpenAIFunctionToolSchema, ToolResponse)
from hybridrl.tools.tool_call import ToolCallResult, run_tool_call
from hybridrl.tools.tools_kwargs import check_tools_kwargs, tool_phase_kwargs
from hybridrl.tools.utils.tool_registry import ToolConfigError, get_tool_class, initialize_tools_from_config
from hybridrl.tools.utils.truncate import truncate_text

__all__ = ["BaseTool", "OpenAIFunctionCallSchema", "OpenAIFunctionParametersSchema", "OpenAIFunctionParsedSchema",
           "OpenAIFunctionPropertySchema", "OpenAIFunctionSchema", "OpenAIFunctionToolCall",
           "OpenAIFunctionToolSchema", "ToolResponse", "ToolCallResult", "run_tool_call", "check_tools_kwargs",
           "tool_phase_kwargs", "ToolConfigError", "get_tool_class", "initialize_tools_from_config",
           "truncate_text"]
