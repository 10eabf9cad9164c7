"""Checkpoints that never lose work: atomic directories, the "latest" pointer, pruning (models/checkpoint.py writes
the sharded model state into them).

Layout under the checkpoint root (``trainer.default_local_dir``), the same as verl's::

    root/
      latest_checkpointed_iteration.txt     # "N": the step to resume from, written LAST
      global_step_N/
        checkpoint_complete.json            # written just before the rename: the role dirs it was published with
        data.pt                             # the controller's state (trainer/ppo/checkpointing.py)
        actor/                              # save_sharded_model_state + save_hf_config_and_tokenizer
          checkpoint_meta.json              # world size and contents of the save
          model/  optimizer/                # torch.distributed.checkpoint (DCP) directories, one shard file per rank
          extra/rank_R.pt                   # lr scheduler + RNG states of rank R
          huggingface/                      # HF config + tokenizer, for the model merger
        critic/                             # same shape as actor/
      .tmp_global_step_N/                   # a save in progress; never read, removed by the next save

Why a save cannot lose work: everything is written under ``.tmp_global_step_N``; only when every writer is done
is the directory fsynced and renamed to ``global_step_N`` (a rename is atomic), and only then is the pointer
replaced (write a temporary file + ``os.replace``). A process killed at any moment leaves either the old pointer
and the old complete checkpoint, or the new pointer and the new complete checkpoint.

Who calls what: the single controller owns the directory (``atomic_checkpoint_dir``, ``find_latest_checkpoint``,
``prune_checkpoints``); the workers of each role write their shards into the directory it hands them
(``save_sharded_model_state``, models/checkpoint.py). The context manager also works inside a torch.distributed group (rank 0 renames,
after a barrier). All writers must see one file system: a single node, or a shared file system across nodes.

A save the file system fails raises ``CheckpointSaveError`` naming the directory and the OS error
(utils/checkpoint_io.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator

from hybridrl.utils.distributed import barrier_if_distributed, rank_or_zero

logger = logging.getLogger(__name__)

LATEST_POINTER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER_FILE = "checkpoint_complete.json"

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_TMP_PREFIX = ".tmp_"
_TRASH_PREFIX = ".trash_"


def step_dir_name(global_step: int) -> str:
    return f"global_step_{global_step}"


def checkpoint_step(checkpoint_path: str) -> int:
    """The N of a ``.../global_step_N`` path (what the trainer resumes its step counter from)."""
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(checkpoint_path)))
    if match is None:
        raise ValueError(f"checkpoint path {checkpoint_path!r} does not end in global_step_<N>")
    return int(match.group(1))


@contextlib.contextmanager
def atomic_checkpoint_dir(root: str, global_step: int) -> Iterator[str]:
    """Yield ``root/.tmp_global_step_N`` to write a checkpoint into; publish it as ``root/global_step_N`` on success.

    On success: barrier (when torch.distributed is initialised), then rank 0 marks the directory complete, fsyncs
    it, renames it into place and replaces the pointer file last. If the body raises, nothing is renamed and the
    pointer is untouched, so the previous checkpoint stays the one that resumes; the half-written temporary
    directory is removed by the next save. Inside a torch.distributed group every rank must enter and leave it
    together (a rank that raises while the others finish leaves them waiting at the barrier, as any collective).
    """
    final_dir = os.path.join(root, step_dir_name(global_step))
    tmp_dir = os.path.join(root, _TMP_PREFIX + step_dir_name(global_step))
    is_writer = rank_or_zero() == 0
    if is_writer:
        os.makedirs(root, exist_ok=True)
        _remove_leftovers(root)
        os.makedirs(tmp_dir)
    barrier_if_distributed()
    yield tmp_dir
    barrier_if_distributed()
    if is_writer:
        role_dirs = sorted(entry.name for entry in os.scandir(tmp_dir) if entry.is_dir())
        _write_json(os.path.join(tmp_dir, COMPLETE_MARKER_FILE), {"global_step": global_step, "role_dirs": role_dirs})
        _fsync_tree(tmp_dir)
        _move_into_place(tmp_dir, final_dir)
        _write_pointer(root, global_step)
    barrier_if_distributed()


def find_latest_checkpoint(root: str) -> str | None:
    """The ``global_step_N`` directory to resume from, or None when there is no complete checkpoint.

    The pointer file is trusted when it names a complete directory. When it is missing or stale (its directory
    was deleted or never completed), the newest complete ``global_step_*`` is used instead and a warning says so.
    Complete means published by ``atomic_checkpoint_dir`` with all its role directories still there: temporary
    (``.tmp_*``) directories and steps whose actor or critic was pruned are never returned.
    """
    if not os.path.isdir(root):
        return None
    pointer_path = os.path.join(root, LATEST_POINTER_FILE)
    if os.path.exists(pointer_path):
        with open(pointer_path) as f:
            text = f.read().strip()
        if text.isdigit() and _is_complete(os.path.join(root, step_dir_name(int(text)))):
            return os.path.join(root, step_dir_name(int(text)))
        logger.warning("%s says %r, which is not a complete checkpoint; using the newest complete one instead",
                       pointer_path, text)
    complete_steps = [step for step in _step_dirs(root) if _is_complete(os.path.join(root, step_dir_name(step)))]
    if not complete_steps:
        return None
    return os.path.join(root, step_dir_name(complete_steps[-1]))


def prune_checkpoints(root: str, max_to_keep: int | None, subdir: str = "actor") -> list[str]:
    """Delete ``global_step_N/<subdir>`` of all but the ``max_to_keep`` newest published checkpoints having it.

    Call it after a save has completed, so the newest checkpoint is always among those kept. ``None`` or ``-1``
    keeps everything (verl's convention). Each role is pruned on its own (``max_actor_ckpt_to_keep``,
    ``max_critic_ckpt_to_keep``); a step missing a role directory it was published with is no longer resumable
    (see ``find_latest_checkpoint``), and once no role directory is left the whole step directory goes.
    Returns the deleted subdir paths, oldest first.
    """
    if max_to_keep is None or max_to_keep == -1:
        return []
    if max_to_keep < 1:
        raise ValueError(f"max_to_keep must be None, -1 (keep all) or >= 1, got {max_to_keep}")
    published = [s for s in _step_dirs(root) if os.path.isdir(os.path.join(root, step_dir_name(s), subdir))
                 and os.path.isfile(os.path.join(root, step_dir_name(s), COMPLETE_MARKER_FILE))]
    deleted = []
    for step in published[:-max_to_keep]:
        step_dir = os.path.join(root, step_dir_name(step))
        _delete_dir(os.path.join(step_dir, subdir))
        deleted.append(os.path.join(step_dir, subdir))
        if not any(entry.is_dir() for entry in os.scandir(step_dir)):
            _delete_dir(step_dir)
    return deleted


def _step_dirs(root: str) -> list[int]:
    """Steps N of the ``global_step_N`` directories directly under root, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(root))
                  if m and os.path.isdir(os.path.join(root, m.group(0))))


def _is_complete(step_dir: str) -> bool:
    """Published by atomic_checkpoint_dir and still holding every role directory it was published with."""
    marker_path = os.path.join(step_dir, COMPLETE_MARKER_FILE)
    if not os.path.isfile(marker_path):
        return False
    with open(marker_path) as f:
        role_dirs = json.load(f)["role_dirs"]
    return all(os.path.isdir(os.path.join(step_dir, name)) for name in role_dirs)


def _remove_leftovers(root: str) -> None:
    """Remove what interrupted saves and prunes left (only one save runs at a time): temporary dirs and files."""
    for entry in os.scandir(root):
        if not entry.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
            continue
        if entry.is_dir():
            shutil.rmtree(entry.path)
        else:
            os.remove(entry.path)


def _move_into_place(tmp_dir: str, final_dir: str) -> None:
    """Rename tmp_dir to final_dir. A directory already there (the same step saved again) is moved aside first."""
    root = os.path.dirname(final_dir)
    if os.path.exists(final_dir):
        trash = os.path.join(root, _TRASH_PREFIX + os.path.basename(final_dir))
        os.rename(final_dir, trash)
        os.rename(tmp_dir, final_dir)
        shutil.rmtree(trash)
    else:
        os.rename(tmp_dir, final_dir)
    _fsync_dir(root)


def _delete_dir(path: str) -> None:
    """Rename then delete, so a kill midway never leaves a half-deleted directory under its real name."""
    trash = os.path.join(os.path.dirname(path), _TRASH_PREFIX + os.path.basename(path))
    os.rename(path, trash)
    shutil.rmtree(trash)


def _write_pointer(root: str, global_step: int) -> None:
    pointer_path = os.path.join(root, LATEST_POINTER_FILE)
    tmp_path = os.path.join(root, _TMP_PREFIX + LATEST_POINTER_FILE)
    with open(tmp_path, "w") as f:
        f.write(str(global_step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, pointer_path)
    _fsync_dir(root)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def _fsync_tree(top: str) -> None:
    """Flush every file and directory under top to disk, whichever process wrote them."""
    for dirpath, _, filenames in os.walk(top):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
