"""Read a .safetensors file's header without loading its tensors: enough to tell a complete file from a damaged
or truncated one, to count the numbers it holds, and to list a checkpoint's tensor shapes.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON header giving each tensor's dtype,
shape and [begin, end) byte range in the data section (plus an optional "__metadata__" entry), then the data
section. A complete file ends exactly where its last tensor's data ends; reading 8 + N bytes tells whether it does.
"""
from __future__ import annotations

import json
import math
import os
import struct

METADATA_KEY = "__metadata__"


class UnreadableSafetensors(ValueError):
    """The file is missing, truncated, or its header is not what a safetensors writer writes."""


def read_header(path: str) -> dict:
    """The tensor entries of the header ({name: {"dtype", "shape", "data_offsets"}}), after checking that the file
    holds exactly the data they describe; raises UnreadableSafetensors saying what is wrong (the file's base name
    first)."""
    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise UnreadableSafetensors(f"{name} is missing")
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            (header_length,) = struct.unpack("<Q", f.read(8))
            if 8 + header_length > size:
                raise UnreadableSafetensors(f"{name} is truncated ({size} bytes, shorter than its "
                                            f"{header_length}-byte header)")
            header = json.loads(f.read(header_length))
        tensors = {key: entry for key, entry in header.items() if key != METADATA_KEY}
        data_end = max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
        for entry in tensors.values():
            math.prod(entry["shape"])  # a shape that is not a list of ints is a damaged header
    except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        if isinstance(err, UnreadableSafetensors):
            raise
        raise UnreadableSafetensors(f"{name} has an unreadable header ({err})") from err
    if size != 8 + header_length + data_end:
        raise UnreadableSafetensors(f"{name} is {size} bytes, its header describes {8 + header_length + data_end} "
                                    f"(truncated or damaged)")
    return tensors


def safetensors_problem(path: str) -> str | None:
    """None when the file's size matches what its header describes; else what is wrong (missing, truncated, ...)."""
    try:
        read_header(path)
    except UnreadableSafetensors as err:
        return str(err)
    return None


def count_elements(path: str) -> int:
    """How many numbers (parameters) the file's tensors hold, read from the header alone."""
    return sum(math.prod(entry["shape"]) for entry in read_header(path).values())


def safetensors_files(model_dir: str) -> list[str] | None:
    """The safetensors files transformers loads from `model_dir` (model.safetensors, else the shards its index
    names); None when the directory has neither. An index without a weight_map raises what reading it raised."""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.isfile(index_path):
        return None
    with open(index_path) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(model_dir, shard) for shard in shards]


def checkpoint_shapes(model_dir: str) -> list[list[int]] | None:
    """The shape of every tensor of the directory's safetensors checkpoint; None when it has none."""
    files = safetensors_files(model_dir)
    if files is None:
        return None
    return [entry["shape"] for path in files for entry in read_header(path).values()]
