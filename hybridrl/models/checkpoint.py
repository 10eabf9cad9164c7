"""Sharded model state: each rank saves and loads its own shards of the model and optimizer, plus its LR scheduler and
RNG states, into a role directory of a checkpoint (trainer/checkpoint_dir.py makes the directory and its layout).

Model and optimizer go through torch.distributed.checkpoint (DCP), one shard file per rank, resharded on load when the
world size changed. Our own files are read with ``torch.load(weights_only=True)`` (utils/checkpoint_io.py); DCP's
metadata (``model/.metadata``, ``optimizer/.metadata``) is unpickled by torch itself: resume only from a checkpoint
directory you trust.
"""
from __future__ import annotations

import json
import logging
import os
import random

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from hybridrl.utils.checkpoint_io import load_file, save_failures_named, save_file
from hybridrl.utils.distributed import barrier_if_distributed, is_distributed, world_size_or_one

logger = logging.getLogger(__name__)

SHARD_META_FILE = "checkpoint_meta.json"
HF_SUBDIR = "huggingface"
VALID_CONTENTS = ("model", "optimizer", "extra")


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
            dcp.save(model_state, checkpoint_id=os.path.join(path, "model"), no_dist=not is_distributed())
        if "optimizer" in contents:
            dcp.save(optimizer_state, checkpoint_id=os.path.join(path, "optimizer"), no_dist=not is_distributed())
        if "extra" in contents:
            os.makedirs(os.path.join(path, "extra"), exist_ok=True)
            extra = {"lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
                     "rng": _rng_states()}
            save_file(extra, os.path.join(path, "extra", f"rank_{rank}.pt"))
        if rank == 0:
            _write_json(os.path.join(path, SHARD_META_FILE),
                        {"world_size": world_size_or_one(), "save_contents": sorted(contents)})
    barrier_if_distributed()


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
        dcp.load(model_state, checkpoint_id=os.path.join(path, "model"), no_dist=not is_distributed())
        set_model_state_dict(model, model_state)
    if "optimizer" in contents:
        dcp.load(optimizer_state, checkpoint_id=os.path.join(path, "optimizer"), no_dist=not is_distributed())
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
    same_world = saved_world_size == world_size_or_one()
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
                       path, saved_world_size, world_size_or_one())


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


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
