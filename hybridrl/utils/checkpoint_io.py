"""Checkpoint files: a failed write names its OS error, a read runs no code.

A write that fails deep inside torch says little: torch's own file writer reports a full disk as "unexpected pos 704
vs 598", distributed checkpoint (DCP) wraps each rank's error in a CheckpointException, Ray wraps a worker's in a
RayTaskError. `save_file` writes through a Python file object, so the OS error surfaces, and `save_failures_named`
turns a save's failure from the file system into one CheckpointSaveError: what was being saved, and the OS error
under it ("[Errno 28] No space left on device: '<file>' (0 B free on that file system)").

`load_file` reads with torch.load(weights_only=True), so a file planted in a checkpoint directory cannot run code.
"""
from __future__ import annotations

import contextlib
import errno
import pickle
import re
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.api import CheckpointException

from hybridrl.utils.disk import exception_chain, free_bytes, human_bytes, underlying_os_error


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written. The message says what was being saved and the OS error under the failure;
    `errno` is that error's number (errno.ENOSPC for a full disk; None for a DCP failure without one). Both survive
    pickling, so the error crosses from a Ray worker to the controller intact."""

    def __init__(self, message: str, errno_code: int | None = None):
        super().__init__(message, errno_code)
        self.errno = errno_code

    def __str__(self) -> str:
        return self.args[0]


@contextlib.contextmanager
def save_failures_named(path: str, doing: str) -> Iterator[None]:
    """Raise a failure inside the block that comes from the file system as CheckpointSaveError("<doing>: <why>"),
    `why` being the OS error in the failure's chain (see utils/disk.py), plus the free space left under `path` when
    the disk is full. Any other exception passes unchanged, except torch's CheckpointException (a BaseException,
    which a Ray worker should not raise): it becomes a CheckpointSaveError naming the rank's failure."""
    try:
        yield
    except (Exception, CheckpointException) as err:
        why = _why_save_failed(err, path)
        if why is None:
            raise
        raise CheckpointSaveError(f"{doing}: {why[0]}", why[1]) from err


def _why_save_failed(err: BaseException, path: str) -> tuple[str, int | None] | None:
    inner = next((e for e in exception_chain(err) if type(e) is CheckpointSaveError), None)
    if inner is not None:  # a worker already said what failed
        return str(inner), inner.errno
    os_error = underlying_os_error(err)
    if os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{os_error} ({human_bytes(free_bytes(path))} free on that file system)", os_error.errno
    if os_error is not None:
        return str(os_error), os_error.errno
    if isinstance(err, CheckpointException):
        return _describe(err), None
    return None


def _describe(err: BaseException) -> str:
    """One line for the first rank's failure under DCP's CheckpointException (under Ray's wrapper, the cause's)."""
    remote = getattr(err, "cause", None)
    if isinstance(remote, BaseException):
        return _describe(remote)
    if isinstance(err, CheckpointException) and err.failures:
        return _describe(next(iter(err.failures.values()))[0])
    return f"{type(err).__name__}: {err}"


def save_file(obj, path: str) -> None:
    """torch.save through a Python file object, so a failed write raises the OSError the OS reported, with the
    file's name (torch's own file writer reports a full disk as "unexpected pos 704 vs 598")."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, path) from err


def load_file(path: str, hint: str = ""):
    """torch.load(weights_only=True): tensors and plain values only, so a planted file cannot run code. A file
    holding anything else raises ValueError naming it and the Python object it asks for (plus `hint`)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        asked = re.search(r"GLOBAL (\S+)", str(err))
        raise ValueError(f"{path}: expected tensors and plain values only (checkpoint files are read with "
                         f"torch.load(weights_only=True)), got a pickle that asks for "
                         f"{asked.group(1) if asked else 'other Python objects'}; hybridrl does not write such files "
                         f"(an older hybridrl saved numpy RNG state){'; ' + hint if hint else ''}") from err
