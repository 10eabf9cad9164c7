from hybridrl.agent_loop.tool_parser import FunctionCall, ToolParser

__all__ = ["FunctionCall", "ToolParser"]
