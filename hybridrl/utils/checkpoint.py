"""Checkpoints that never lose work: atomic directories, the "latest" pointer, pruning, sharded model state.

Layout under the checkpoint root (``trainer.default_local_dir``), the same as verl's::

    root/
      latest_checkpointed_iteration.txt     # "N": the step to resume from, written LAST
      global_step_N/
        checkpoint_complete.json            # written just before the rename: the role dirs it was published with
        data.pt                             # dataloader state (written by the trainer)
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
(``save_sharded_model_state``). The context manager also works inside a torch.distributed group (rank 0 renames,
after a barrier). All writers must see one file system: a single node, or a shared file system across nodes.

A save the file system fails raises ``CheckpointSaveError`` naming the directory and the OS error; our own files
are read with ``torch.load(weights_only=True)`` (see checkpoint_io.py). torch's distributed-checkpoint metadata
(``model/.metadata``, ``optimizer/.metadata``) is still unpickled by torch itself: resume only from a checkpoint
directory you trust.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from hybridrl.utils.checkpoint_io import load_file, save_failures_named, save_file

logger = logging.getLogger(__name__)

LATEST_POINTER_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER_FILE = "checkpoint_complete.json"
SHARD_META_FILE = "checkpoint_meta.json"
HF_SUBDIR = "huggingface"
VALID_CONTENTS = ("model", "optimizer", "extra")

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_TMP_PREFIX = ".tmp_"
_TRASH_PREFIX = ".trash_"


# ----------------------------------------------------------------------------------------------------------------
# Directory mechanics (controller side)
# ----------------------------------------------------------------------------------------------------------------

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
    is_writer = _rank() == 0
    if is_writer:
        os.makedirs(root, exist_ok=True)
        _remove_leftovers(root)
        os.makedirs(tmp_dir)
    _barrier()
    yield tmp_dir
    _barrier()
    if is_writer:
        role_dirs = sorted(entry.name for entry in os.scandir(tmp_dir) if entry.is_dir())
        _write_json(os.path.join(tmp_dir, COMPLETE_MARKER_FILE), {"global_step": global_step, "role_dirs": role_dirs})
        _fsync_tree(tmp_dir)
        _move_into_place(tmp_dir, final_dir)
        _write_pointer(root, global_step)
    _barrier()


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


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


# ----------------------------------------------------------------------------------------------------------------
# Sharded model state (worker side, every rank calls these together)
# ----------------------------------------------------------------------------------------------------------------

def save_sharded_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler,
                             path: str, rank: int, save_contents: list[str]) -> None:
    """Save this rank's shards of an FSDP2 / FSDP / plain model into ``path`` (a collective: all ranks call it).

    ``save_contents`` is a subset of ``("model", "optimizer", "extra")``; "extra" is the lr scheduler state and
    this rank's RNG states (python, numpy, torch CPU and CUDA). Model and optimizer go through
    torch.distributed.checkpoint, so each rank writes only its own shard and memory does not grow with world size.
    Save after the first optimizer step: DCP creates missing optimizer state with a zero-gradient, zero-lr step.
    """
    contents = _checked_contents(save_contents, "save_contents")
    _check_needs_optimizer(contents, optimizer, "save")
    with save_failures_named(path, f"could not write checkpoint files to {path}"):
        os.makedirs(path, exist_ok=True)
        model_state, optimizer_state = _current_state(model, optimizer if "optimizer" in contents else None)
        if "model" in contents:
            dcp.save(model_state, checkpoint_id=os.path.join(path, "model"), no_dist=not _distributed())
        if "optimizer" in contents:
            dcp.save(optimizer_state, checkpoint_id=os.path.join(path, "optimizer"), no_dist=not _distributed())
        if "extra" in contents:
            os.makedirs(os.path.join(path, "extra"), exist_ok=True)
            extra = {"lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
                     "rng": _rng_states()}
            save_file(extra, os.path.join(path, "extra", f"rank_{rank}.pt"))
        if rank == 0:
            _write_json(os.path.join(path, SHARD_META_FILE),
                        {"world_size": _world_size(), "save_contents": sorted(contents)})
    _barrier()


def load_sharded_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, lr_scheduler,
                             path: str, rank: int, load_contents: list[str]) -> None:
    """Load what ``save_sharded_model_state`` wrote into ``path`` (a collective: all ranks call it).

    A different world size than at save time works for model and optimizer: DCP reshards on load. RNG states
    belong to ranks that no longer exist then, so they are not restored (a warning says so; the run continues but
    is no longer an exact replay); the lr scheduler, identical on every rank, is restored from rank 0's file.
    """
    contents = _checked_contents(load_contents, "load_contents")
    _check_needs_optimizer(contents, optimizer, "load")
    meta = _read_shard_meta(path)
    missing = sorted(contents - set(meta["save_contents"]))
    if missing:
        raise ValueError(f"load_contents asks for {missing} but the checkpoint in {path} holds only "
                         f"{meta['save_contents']}")
    model_state, optimizer_state = _current_state(model, optimizer if "optimizer" in contents else None)
    if "model" in contents:
        dcp.load(model_state, checkpoint_id=os.path.join(path, "model"), no_dist=not _distributed())
        set_model_state_dict(model, model_state)
    if "optimizer" in contents:
        dcp.load(optimizer_state, checkpoint_id=os.path.join(path, "optimizer"), no_dist=not _distributed())
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=_FLAT_OPTIMIZER)
    if "extra" in contents:
        _load_extra(path, rank, meta["world_size"], lr_scheduler)


def save_hf_config_and_tokenizer(path: str, hf_config, tokenizer, generation_config=None) -> str:
    """Write the HF config, tokenizer (or processor) and generation config into ``path/huggingface``.

    The model merger builds the exported HF model from these files; rank 0 calls this once per save.
    """
    hf_dir = os.path.join(path, HF_SUBDIR)
    os.makedirs(hf_dir, exist_ok=True)
    hf_config.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    if generation_config is not None:
        generation_config.save_pretrained(hf_dir)
    return hf_dir


# Optimizer state as one flat dict ("state.<param>.exp_avg", "param_groups.<param>.lr"): DCP's own flattening of
# the nested form treats the param_groups list as one opaque value on some models (an FSDP1 value model failed to
# load with "Missing key in checkpoint state_dict: param_groups"), the flat form has no such ambiguity.
_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)


def _current_state(model, optimizer) -> tuple[dict, dict]:
    """Sharded state dicts keyed by parameter names (so DCP can reshard); optimizer state is created if empty."""
    if optimizer is None:
        return get_model_state_dict(model), {}
    return get_state_dict(model, optimizer, options=_FLAT_OPTIMIZER)


def _checked_contents(contents: list[str], key: str) -> set[str]:
    unknown = sorted(set(contents) - set(VALID_CONTENTS))
    if unknown or not contents:
        raise ValueError(f"checkpoint.{key} must be a non-empty subset of {list(VALID_CONTENTS)}, got {contents}")
    return set(contents)


def _check_needs_optimizer(contents: set[str], optimizer, action: str) -> None:
    if "optimizer" in contents and optimizer is None:
        raise ValueError(f"checkpoint contents include 'optimizer' but no optimizer was given to {action}")


def _read_shard_meta(path: str) -> dict:
    meta_path = os.path.join(path, SHARD_META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{meta_path} is missing: {path} is not a directory written by "
                                "save_sharded_model_state")
    with open(meta_path) as f:
        return json.load(f)


def _load_extra(path: str, rank: int, saved_world_size: int, lr_scheduler) -> None:
    same_world = saved_world_size == _world_size()
    extra_path = os.path.join(path, "extra", f"rank_{rank if same_world else 0}.pt")
    extra = load_file(extra_path, hint="to resume without the LR schedule and RNG states, leave 'extra' out of "
                                       "checkpoint.load_contents")
    if (extra["lr_scheduler"] is None) != (lr_scheduler is None):
        saved = "no lr_scheduler state" if extra["lr_scheduler"] is None else "lr_scheduler state"
        raise ValueError(f"{extra_path} has {saved} but the caller passed lr_scheduler={lr_scheduler!r}")
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(extra["lr_scheduler"])
    if same_world:
        _set_rng_states(extra["rng"])
    else:
        logger.warning("checkpoint %s was saved with world size %d, now %d: model and optimizer were resharded, "
                       "RNG states were NOT restored (resume is not an exact replay)",
                       path, saved_world_size, _world_size())


def _rng_states() -> dict:
    """This process's RNG states as tensors, ints, floats, strings and tuples: what load_file reads back (numpy's
    key array becomes a list of ints)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, keys.tolist(), position, has_gauss, cached_gaussian),
            "torch_cpu": torch.get_rng_state(),
            "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    name, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch_cpu"])
    if states["torch_cuda"] is None:
        return
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["torch_cuda"])
    else:
        logger.warning("the checkpoint has CUDA RNG states but this process has no CUDA device: not restored")
