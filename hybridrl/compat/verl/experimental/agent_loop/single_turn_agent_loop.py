from hybridrl.agent_loop.single_turn import SingleTurnAgentLoop

__all__ = ["SingleTurnAgentLoop"]
