from hybridrl.agent_loop.base import TokenOutput

__all__ = ["TokenOutput"]
