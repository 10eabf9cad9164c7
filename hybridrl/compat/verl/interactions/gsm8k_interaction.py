from hybridrl.interactions.gsm8k_interaction import Gsm8kInteraction

__all__ = ["Gsm8kInteraction"]
