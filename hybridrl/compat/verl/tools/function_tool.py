from hybridrl.tools.function_tool import FunctionTool, normalize_function_tool_return

__all__ = ["FunctionTool", "normalize_function_tool_return"]
