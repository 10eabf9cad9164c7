from hybridrl.data.rl_dataset import RLHFDataset

__all__ = ["RLHFDataset"]
