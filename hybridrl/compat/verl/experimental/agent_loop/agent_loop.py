from hybridrl.agent_loop.base import (AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, DictConfigWrap, ToolListWrap,
                                      register)
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager

__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "AsyncLLMServerManager", "DictConfigWrap",
           "ToolListWrap", "register"]
