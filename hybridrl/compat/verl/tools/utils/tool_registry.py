from hybridrl.tools.utils.tool_registry import get_tool_class, initialize_tools_from_config

__all__ = ["get_tool_class", "initialize_tools_from_config"]
