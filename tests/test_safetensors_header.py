"""The safetensors header reader: complete files pass and count their numbers, damaged ones say what is wrong."""
import json
import os
import struct

import pytest
import torch
from safetensors.torch import save_file

from hybridrl.utils.safetensors_header import checkpoint_shapes, count_elements, safetensors_problem
from hybridrl.workers.rollout.sglang_weights import bucket_capacity


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


def test_checkpoint_shapes_read_every_shard_an_index_names(tmp_path):
    save_file({"a": torch.zeros(2, 3)}, str(tmp_path / "one.safetensors"))
    save_file({"b": torch.zeros(5), "c": torch.zeros(1, 1, 4)}, str(tmp_path / "two.safetensors"))
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors", "c": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(checkpoint_shapes(str(tmp_path))) == [[1, 1, 4], [2, 3], [5]]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(KeyError, match="weight_map"):
        checkpoint_shapes(str(tmp_path))
    assert checkpoint_shapes(str(tmp_path / "missing")) is None


def test_the_weight_bucket_is_capped_at_the_checkpoint_in_the_rollout_dtype(tmp_path):
    """2,000 + 10 bf16 numbers: 4,000 and 20 bytes, each rounded up to FlatBucket's 256-byte alignment
    (4,096 + 256); a 1 MiB bucket shrinks to that, a checkpoint larger than the bucket leaves it as configured."""
    save_file({"w": torch.zeros(2000), "b": torch.zeros(10)}, str(tmp_path / "model.safetensors"))
    assert bucket_capacity(1, torch.bfloat16, str(tmp_path)) == 4096 + 256
    assert bucket_capacity(1, torch.float32, str(tmp_path)) == 8192 + 256
    save_file({"w": torch.zeros(300_000)}, str(tmp_path / "model.safetensors"))  # 600,000 bf16 bytes
    assert bucket_capacity(1, torch.bfloat16, str(tmp_path)) == 600_064
    assert bucket_capacity(1, torch.float32, str(tmp_path)) == 1 << 20
    assert bucket_capacity(2, torch.bfloat16, str(tmp_path / "pickled")) == 2 << 20  # no safetensors: as configured
