from hybridrl.data.rl_dataset import RLHFDataset, collate_fn, get_dataset_class

__all__ = ["RLHFDataset", "collate_fn", "get_dataset_class"]
