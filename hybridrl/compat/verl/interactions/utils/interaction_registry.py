from hybridrl.interactions.registry import get_interaction_class, initialize_interactions_from_config

__all__ = ["get_interaction_class", "initialize_interactions_from_config"]
