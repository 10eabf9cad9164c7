"""The safetensors header reader: complete files pass and count their numbers, damaged ones say what is wrong."""
import json
import os
import struct

import torch
from safetensors.torch import save_file

from hybridrl.utils.safetensors_header import count_elements, safetensors_problem


def test_safetensors_check_reads_the_header_not_the_weights(tmp_path):
    path = str(tmp_path / "model.safetensors")
    save_file({"w": torch.zeros(4, 4), "b": torch.zeros(3, dtype=torch.bfloat16)}, path)
    assert safetensors_problem(path) is None
    assert count_elements(path) == 4 * 4 + 3
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0")
    assert safetensors_problem(path) == (f"model.safetensors is {size + 1} bytes, its header describes {size} "
                                         "(truncated or damaged)")
    with open(path, "r+b") as f:
        f.truncate(size - 10)  # the last tensor's data cut short, as by an interrupted copy
    assert safetensors_problem(path) == (f"model.safetensors is {size - 10} bytes, its header describes {size} "
                                         "(truncated or damaged)")
    with open(path, "r+b") as f:
        f.truncate(20)
    (header_length,) = struct.unpack("<Q", open(path, "rb").read(8))
    assert safetensors_problem(path) == (f"model.safetensors is truncated (20 bytes, shorter than its "
                                         f"{header_length}-byte header)")
    with open(path, "r+b") as f:
        f.truncate(4)
    assert safetensors_problem(path) == "model.safetensors has an unreadable header (unpack requires a buffer of 8 bytes)"
    assert safetensors_problem(str(tmp_path / "none.safetensors")) == "none.safetensors is missing"


def test_a_header_that_is_not_a_tensor_table_is_unreadable(tmp_path):
    def write(header: bytes) -> str:
        path = str(tmp_path / "w.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
        return path

    assert safetensors_problem(write(b"{not json")).startswith("w.safetensors has an unreadable header (Expecting")
    assert safetensors_problem(write(b"[1, 2]")) == ("w.safetensors has an unreadable header ('list' object has no "
                                                     "attribute 'items')")
    no_offsets = json.dumps({"w": {"dtype": "F32", "shape": [2]}}).encode()
    assert safetensors_problem(write(no_offsets)) == "w.safetensors has an unreadable header ('data_offsets')"
    only_metadata = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    assert safetensors_problem(write(only_metadata)) is None and count_elements(write(only_metadata)) == 0
