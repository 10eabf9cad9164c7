"""Read one split of a dataset from a local copy (offline) or the HF hub (online), as a list of dicts.

A local copy is a directory holding one or more files per split whose names start with the split
name: `train.jsonl`, `test.parquet`, or the hub's own `main/train-00000-of-00001.parquet`.
`datasets` is imported only for the hub path, so the offline path needs just pandas.
"""
import glob
import os

import pandas as pd

_READERS = {".parquet": pd.read_parquet, ".jsonl": lambda path: pd.read_json(path, lines=True),
            ".json": pd.read_json}


def load_split(split: str, local_dataset_path: str | None, hub_name: str, hub_config: str | None = None) -> list[dict]:
    if local_dataset_path:
        return _load_local_split(split, os.path.expanduser(local_dataset_path))
    try:
        import datasets  # only needed online
    except ImportError as error:
        raise ImportError(f"reading {hub_name} from the HF hub needs `pip install datasets`; offline, pass "
                          "--local_dataset_path DIR with train*/test* parquet or jsonl files") from error

    return list(datasets.load_dataset(hub_name, hub_config, split=split))


def _load_local_split(split: str, directory: str) -> list[dict]:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--local_dataset_path {directory} is not a directory")
    files = sorted(path for path in glob.glob(os.path.join(directory, "**", f"{split}*"), recursive=True)
                   if os.path.splitext(path)[1] in _READERS)
    if not files:
        raise FileNotFoundError(f"no {split} file under {directory}: expected {split}*.parquet, {split}*.jsonl "
                                f"or {split}*.json")
    frames = [_READERS[os.path.splitext(path)[1]](path) for path in files]
    return pd.concat(frames, ignore_index=True).to_dict(orient="records")
