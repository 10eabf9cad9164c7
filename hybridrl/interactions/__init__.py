"""Interactions: a simulated user that answers the model's turns (verl's `verl.interactions`).

    from hybridrl.interactions import BaseInteraction, initialize_interactions_from_config
    interactions = initialize_interactions_from_config("interaction_config.yaml")   # name -> instance

The tool_agent loop (agent_loop/tool_agent.py) uses the one a sample's `interaction_kwargs["name"]`
names when actor_rollout_ref.rollout.multi_turn.interaction_config_path is set. Built-in:
gsm8k_interaction.Gsm8kInteraction (verl's example).
"""
from hybridrl.interactions.base import BaseInteraction
from hybridrl.interactions.registry import get_interaction_class, initialize_interactions_from_config

__all__ = ["BaseInteraction", "get_interaction_class", "initialize_interactions_from_config"]
