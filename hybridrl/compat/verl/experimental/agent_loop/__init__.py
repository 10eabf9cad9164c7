from hybridrl.agent_loop.base import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, DictConfigWrap, register
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager
from hybridrl.agent_loop.single_turn import SingleTurnAgentLoop
from hybridrl.agent_loop.tool_agent import ToolAgentLoop

__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "AsyncLLMServerManager", "DictConfigWrap",
           "SingleTurnAgentLoop", "ToolAgentLoop", "register"]
