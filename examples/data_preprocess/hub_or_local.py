"""Read one split of a dataset from a local copy (offline) or the HF hub (online), as a list of dicts; and the
command line every hub-dataset preprocess script shares (`convert_hub_dataset`).

A local copy is a directory holding one or more files per split whose names start with the split
name: `train.jsonl`, `test.parquet`, or the hub's own `main/train-00000-of-00001.parquet`.
`datasets` is imported only for the hub path, so the offline path needs just pandas.
"""
import argparse
import glob
import os
from typing import Callable

import pandas as pd

from hybridrl.data.rl_parquet import write_rl_parquet

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


def convert_hub_dataset(description: str, default_local_dir: str, to_row: Callable[[dict, str, int], dict],
                        hub_name: str, hub_config: str | None = None) -> None:
    """`--local_dataset_path DIR` (offline) or the hub -> `to_row(example, split, index)` for every example ->
    `<local_dir>/train.parquet` and `test.parquet` in verl's layout."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_dataset_path", default=None, help="offline copy: a dir with train*/test* files")
    parser.add_argument("--local_dir", default=default_local_dir)
    args = parser.parse_args()
    for split in ("train", "test"):
        examples = load_split(split, args.local_dataset_path, hub_name=hub_name, hub_config=hub_config)
        rows = [to_row(example, split, index) for index, example in enumerate(examples)]
        path = os.path.join(os.path.expanduser(args.local_dir), f"{split}.parquet")
        write_rl_parquet(rows, path)
        print(f"wrote {len(rows)} rows to {path}")
