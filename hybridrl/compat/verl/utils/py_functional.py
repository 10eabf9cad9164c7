from hybridrl.utils.metric import append_to_dict

__all__ = ["append_to_dict"]
