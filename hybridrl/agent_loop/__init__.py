"""The controller side of rollout: agent loops, run one per sample against the engines' servers.

Public API (verl's names, so verl agent loops port by changing imports):
AgentLoopBase, AgentLoopOutput, AgentLoopMetrics, TokenOutput, DictConfigWrap, ToolListWrap, register. The manager
(manager.py) and the server manager (server_manager.py) are imported from their modules: they need Ray/aiohttp.
"""
from hybridrl.agent_loop import gpt_oss  # noqa: F401 - registers the "gpt-oss" tool parser beside tool_parser's own
from hybridrl.agent_loop.base import (AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, DictConfigWrap, TokenOutput,
                                      ToolListWrap, register)

__all__ = ["AgentLoopBase", "AgentLoopMetrics", "AgentLoopOutput", "DictConfigWrap", "TokenOutput", "ToolListWrap",
           "register"]
