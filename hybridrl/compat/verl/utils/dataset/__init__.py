from hybridrl.utils.dataset import RLHFDataset

__all__ = ["RLHFDataset"]
