from hybridrl.agent_loop.base import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, DictConfigWrap, register
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager

__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "AsyncLLMServerManager", "DictConfigWrap",
           "register"]
