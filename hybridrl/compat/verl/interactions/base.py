from hybridrl.interactions.base import BaseInteraction

__all__ = ["BaseInteraction"]
