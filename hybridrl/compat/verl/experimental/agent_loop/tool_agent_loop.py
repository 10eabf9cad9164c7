from hybridrl.agent_loop.tool_agent import ToolAgentLoop

__all__ = ["ToolAgentLoop"]
