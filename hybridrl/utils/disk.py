"""The file system a run writes to: free space, byte counts in words, and the OS error under a failed write.

A write that fails deep inside torch or Ray reaches the caller wrapped: torch's distributed checkpoint gathers each
rank's exception into one CheckpointException, Ray wraps a worker's exception in a RayTaskError (`.cause`), and
Python chains the rest (`__cause__`, `__context__`). `exception_chain` walks all of these, so the OSError with its
errno ("[Errno 28] No space left on device") can be found and named.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds `path` (or would hold it: its nearest existing ancestor)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return shutil.disk_usage(existing).free


def human_bytes(count: float) -> str:
    """1536 -> '1.5 KiB': binary units, one decimal."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def exception_chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, then every exception under it, breadth first: Ray's remote cause, the per-rank failures of torch's
    CheckpointException, `__cause__` and `__context__`."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen: set[int] = set()
    pending = [err]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        under = [getattr(current, "cause", None), current.__cause__, current.__context__]
        if isinstance(current, CheckpointException):
            under += [failure for failure, _traceback in current.failures.values()]
        pending += [candidate for candidate in under if isinstance(candidate, BaseException)]


def underlying_os_error(err: BaseException) -> OSError | None:
    """The first OSError in `err`'s chain (see exception_chain), or None. A Ray wrapper that merely poses as its
    cause's class is passed over for the cause itself, which carries the errno."""
    return next((candidate for candidate in exception_chain(err) if isinstance(candidate, OSError)
                 and not isinstance(getattr(candidate, "cause", None), BaseException)), None)
