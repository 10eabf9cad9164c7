"""verl's `copy` and `makedirs` for the data-preprocessing scripts (their --hdfs_dir upload), on local paths only:
hybridrl reads and writes local files; an hdfs:// path is refused by name."""
from __future__ import annotations

import os
import shutil


def makedirs(name: str, mode: int = 0o777, exist_ok: bool = False, **kwargs) -> None:
    os.makedirs(_local(name), mode=mode, exist_ok=exist_ok)


def copy(src: str, dst: str, **kwargs) -> bool:
    """Copy a file or a directory tree; True as verl's does."""
    src, dst = _local(src), _local(dst)
    if os.path.isdir(src):
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        shutil.copy(src, dst)
    return True


def _local(path: str) -> str:
    if path.startswith("hdfs://"):
        raise ValueError(f"{path!r}: HDFS is not supported here; write to a local path")
    return path
