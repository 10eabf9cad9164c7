"""DataProto: every operation with exact values, files, and what moving one through Ray costs."""
import copy
import pickle
import sys

import numpy as np
import pytest
import ray
import torch

from hybridrl.protocol import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto

# Ray workers cannot import this test module by name; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_data() -> DataProto:
    return DataProto.from_dict(tensors={"x": torch.arange(12).reshape(4, 3), "mask": torch.tensor([1.0, 0.0, 1.0, 0.0])},
                               non_tensors={"uid": ["a", "b", "c", "d"]},
                               meta_info={"temperature": 0.7})


def column(data: DataProto) -> list[int]:
    """The first entry of each row of x: identifies rows (row i of make_data() starts with 3 * i)."""
    return data.batch["x"][:, 0].tolist()


# --------------------------------------------------------------------------------------------------
# construction


def test_from_dict_builds_one_object_per_row():
    data = DataProto.from_dict({"x": torch.zeros(2, 1)}, {"tags": [[1, 2], [3, 4]], "gt": [{"a": 1}, None]}, {"k": 1})
    assert len(data) == 2
    assert data.non_tensor_batch["tags"].shape == (2,)  # not a 2x2 array: each row keeps its list
    assert data.non_tensor_batch["tags"][1] == [3, 4]
    assert data.non_tensor_batch["gt"][0] == {"a": 1}
    assert data.meta_info == {"k": 1}


def test_from_single_dict_sorts_values_by_type():
    data = DataProto.from_single_dict({"x": torch.ones(3), "uid": np.array(["p", "q", "r"], dtype=object),
                                       "names": ["u", "v", "w"]}, meta_info={"step": 2})
    assert list(data.batch) == ["x"]
    assert sorted(data.non_tensor_batch) == ["names", "uid"]
    assert data.non_tensor_batch["names"].tolist() == ["u", "v", "w"]
    assert data.meta_info == {"step": 2}
    with pytest.raises(TypeError, match=r"data\['lr'\] is a float"):
        DataProto.from_single_dict({"x": torch.ones(3), "lr": 0.1})


def test_construction_names_the_key_and_lengths_that_differ():
    with pytest.raises(ValueError, match=r"batch\['x'\] has 3, non_tensor_batch\['uid'\] has 2"):
        DataProto.from_dict({"x": torch.zeros(3, 2)}, {"uid": ["a", "b"]})
    with pytest.raises(TypeError, match=r"batch\['x'\] must be a torch.Tensor, got list"):
        DataProto({"x": [1, 2]})
    with pytest.raises(ValueError, match=r"batch\['loss'\] is a 0-d tensor"):
        DataProto({"loss": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"non_tensor_batch\['uid'\] must be a numpy array"):
        DataProto(non_tensor_batch={"uid": ["a"]})


def test_len_counts_rows_of_any_part():
    assert len(make_data()) == 4
    assert len(DataProto.from_dict(non_tensors={"uid": ["a", "b"]})) == 2
    assert len(DataProto(meta_info={"metrics": {}})) == 0


# --------------------------------------------------------------------------------------------------
# rows and keys


def test_int_index_gives_a_row_item():
    data = make_data()
    item = data[1]
    assert isinstance(item, DataProtoItem)
    assert item.batch["x"].tolist() == [3, 4, 5]
    assert item.batch["mask"].item() == 0.0
    assert item.non_tensor_batch["uid"] == "b"
    assert item.meta_info == {"temperature": 0.7}
    assert data[-1].non_tensor_batch["uid"] == "d"
    with pytest.raises(IndexError, match="index 4 is out of range for 4 rows"):
        data[4]


def test_slices_and_index_arrays_give_dataprotos():
    data = make_data()
    assert column(data[1:3]) == [3, 6]
    assert data[1:3].non_tensor_batch["uid"].tolist() == ["b", "c"]
    assert column(data[[3, 0]]) == [9, 0]
    assert data[np.array([2, 2])].non_tensor_batch["uid"].tolist() == ["c", "c"]
    assert column(data[torch.tensor([1, 3])]) == [3, 9]
    assert data[torch.tensor([True, False, False, True])].non_tensor_batch["uid"].tolist() == ["a", "d"]
    assert data[[0]].meta_info == {"temperature": 0.7}
    with pytest.raises(IndexError, match=r"mask has shape \(2,\), expected \(4,\)"):
        data[np.array([True, False])]


def test_index_arrays_count_negative_indices_from_the_end_and_refuse_others_out_of_range():
    """Rows are taken with index_select (issue 58: 15-1000x faster than advanced indexing on a small CPU batch),
    which knows no negative index; the rows and the error are those of indexing by the array."""
    data = make_data()
    assert column(data[[-1, 0, -4]]) == [9, 0, 0]
    assert data[np.array([-2])].non_tensor_batch["uid"].tolist() == ["c"]
    assert data.select_idxs(torch.tensor([-1, -1])).batch["mask"].tolist() == data[[3, 3]].batch["mask"].tolist()
    assert len(data[[]]) == 0 and data[[]].batch["x"].shape == (0, 3)
    for outside in ([4], [0, -5]):
        with pytest.raises(IndexError, match=f"index {outside[-1]} is out of range for 4 rows"):
            data[outside]


def test_select_shares_tensors_unless_deepcopy():
    data = make_data()
    selected = data.select(batch_keys=["x"], non_tensor_batch_keys=[], meta_info_keys=[])
    assert list(selected.batch) == ["x"] and selected.non_tensor_batch == {} and selected.meta_info == {}
    assert list(data.select().batch) == ["x", "mask"]  # None keeps every key
    copied = data.select(batch_keys=["x"], deepcopy=True)
    data.batch["x"][0, 0] = 100
    assert selected.batch["x"][0, 0].item() == 100
    assert copied.batch["x"][0, 0].item() == 0
    with pytest.raises(KeyError, match=r"batch has no key\(s\) \['y'\]; available: \['mask', 'x'\]"):
        data.select(batch_keys=["y"])


def test_pop_removes_the_keys_from_self():
    data = make_data()
    popped = data.pop(batch_keys=["mask"], non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"])
    assert list(popped.batch) == ["mask"] and popped.batch["mask"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert popped.non_tensor_batch["uid"].tolist() == ["a", "b", "c", "d"]
    assert popped.meta_info == {"temperature": 0.7}
    assert list(data.batch) == ["x"] and data.non_tensor_batch == {} and data.meta_info == {}
    assert len(data.pop()) == 0 and list(data.batch) == ["x"]  # None pops nothing


def test_select_idxs_slice_and_rename_are_verls_names():
    data = make_data()
    assert column(data.select_idxs([3, 1])) == [9, 3]
    assert column(data.select_idxs(np.array([True, False, False, True]))) == [0, 9]
    assert column(data.slice(1, None, 2)) == [3, 9]
    renamed = data.rename(["x", "mask"], ["y", "x"])
    assert renamed is data and sorted(data.batch) == ["x", "y"]
    assert data.batch["x"].tolist() == [1.0, 0.0, 1.0, 0.0] and data.batch["y"][:, 0].tolist() == [0, 3, 6, 9]
    with pytest.raises(KeyError, match=r"no key\(s\) \['z'\] / already has key\(s\) \['x'\]"):
        data.rename(["z", "y"], ["w", "x"])


def test_union_adds_keys_and_rejects_conflicts():
    data = make_data()
    other = DataProto.from_dict({"x": torch.arange(12).reshape(4, 3), "y": torch.ones(4)}, {"uid": ["a", "b", "c", "d"]},
                                {"temperature": 0.7, "step": 3})
    assert data.union(other) is data
    assert sorted(data.batch) == ["mask", "x", "y"] and data.meta_info == {"temperature": 0.7, "step": 3}
    with pytest.raises(ValueError, match=r"union: batch\['y'\] holds different values"):
        data.union(DataProto({"y": torch.zeros(4)}))
    with pytest.raises(ValueError, match=r"union: non_tensor_batch\['uid'\] holds different values"):
        data.union(DataProto.from_dict(non_tensors={"uid": ["a", "b", "c", "z"]}))
    with pytest.raises(ValueError, match=r"union: meta_info\['temperature'\] holds different values"):
        data.union(DataProto(meta_info={"temperature": 1.0}))
    with pytest.raises(ValueError, match="union: DataProtos have 4 and 2 rows"):
        data.union(DataProto({"z": torch.zeros(2)}))
    # each worker call reports its own metrics: they merge (the later call's value wins) instead of conflicting
    data.union(DataProto(meta_info={"metrics": {"perf/mfu/actor_infer": 0.1, "timing_s/a": 1.0}}))
    data.union(DataProto(meta_info={"metrics": {"perf/mfu/ref": 0.2, "timing_s/a": 2.0}}))
    assert data.meta_info["metrics"] == {"perf/mfu/actor_infer": 0.1, "perf/mfu/ref": 0.2, "timing_s/a": 2.0}


# --------------------------------------------------------------------------------------------------
# splitting and joining


def test_chunk_and_concat_round_trip():
    data = make_data()
    chunks = data.chunk(2)
    assert [column(chunk) for chunk in chunks] == [[0, 3], [6, 9]]
    assert [chunk.non_tensor_batch["uid"].tolist() for chunk in chunks] == [["a", "b"], ["c", "d"]]
    joined = DataProto.concat(chunks)
    assert torch.equal(joined.batch["x"], data.batch["x"]) and torch.equal(joined.batch["mask"], data.batch["mask"])
    assert joined.non_tensor_batch["uid"].tolist() == ["a", "b", "c", "d"]
    assert joined.meta_info == {"temperature": 0.7}
    with pytest.raises(ValueError, match="chunk: 4 rows do not split into 3 equal chunks"):
        data.chunk(3)


def test_concat_keeps_first_meta_info_and_merges_metrics():
    first = DataProto({"x": torch.zeros(1)}, meta_info={"rank": 0, "metrics": {"loss": 1.0, "lr": [0.1, 0.1]}})
    second = DataProto({"x": torch.ones(2)}, meta_info={"rank": 1, "metrics": {"loss": 3.0}})
    joined = DataProto.concat([first, second])
    assert joined.batch["x"].tolist() == [0.0, 1.0, 1.0]
    assert joined.meta_info == {"rank": 0, "metrics": {"loss": [1.0, 3.0], "lr": [0.1, 0.1]}}
    with pytest.raises(ValueError, match=r"concat: item 1 has keys \['y'\]"):
        DataProto.concat([first, DataProto({"y": torch.zeros(1)})])


def test_split_keeps_the_remainder_last():
    parts = make_data()[:3].split(2)
    assert [column(part) for part in parts] == [[0, 3], [6]]


def test_repeat_interleaved_or_tiled():
    data = make_data()[:2]
    interleaved = data.repeat(repeat_times=3, interleave=True)
    assert column(interleaved) == [0, 0, 0, 3, 3, 3]
    assert interleaved.non_tensor_batch["uid"].tolist() == ["a", "a", "a", "b", "b", "b"]
    tiled = data.repeat(repeat_times=2, interleave=False)
    assert column(tiled) == [0, 3, 0, 3]
    assert tiled.non_tensor_batch["uid"].tolist() == ["a", "b", "a", "b"]
    assert tiled.meta_info == {"temperature": 0.7}


def test_sample_level_repeat_repeats_each_row_its_own_count():
    repeated = make_data().sample_level_repeat(torch.tensor([2, 0, 1, 3]))
    assert column(repeated) == [0, 0, 6, 9, 9, 9]
    assert repeated.non_tensor_batch["uid"].tolist() == ["a", "a", "c", "d", "d", "d"]
    with pytest.raises(ValueError, match=r"one count >= 0 per row \(4 rows\), got \[1, 2\]"):
        make_data().sample_level_repeat([1, 2])


def test_unfold_column_chunks_cuts_the_split_keys_and_repeats_the_rest():
    data = DataProto.from_dict({"x": torch.arange(8).reshape(2, 4), "y": torch.tensor([10, 20])},
                               {"uid": ["a", "b"]}, {"k": 1})
    unfolded = data.unfold_column_chunks(2, split_keys=["x"])
    assert unfolded.batch["x"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert unfolded.batch["y"].tolist() == [10, 10, 20, 20]
    assert unfolded.non_tensor_batch["uid"].tolist() == ["a", "a", "b", "b"]
    assert unfolded.meta_info == {"k": 1}
    with pytest.raises(ValueError, match=r"non_tensor_batch\['uid'\] has shape \(2,\); its second dimension"):
        data.unfold_column_chunks(2, split_keys=["uid"])


def test_operations_keep_a_subclass_and_accept_any_mapping_of_tensors():
    """verl's DataProto (hybridrl.compat.verl.protocol) is a subclass holding a TensorDict: every operation gives back
    the caller's class, and the constructor takes any mapping with items()."""
    class Tagged(DataProto):
        pass

    data = Tagged.from_dict({"x": torch.arange(4)}, {"uid": ["a", "b", "c", "d"]})
    results = [data[1:3], data[[0, 2]], data.select(["x"]), data.repeat(2), data.chunk(2)[0], copy.deepcopy(data),
               DataProto.concat([data, data]), data.sample_level_repeat([1, 1, 1, 1]), data.unfold_column_chunks(1)]
    assert [type(result).__name__ for result in results] == ["Tagged"] * len(results)

    class Mapping:
        def items(self):
            return [("x", torch.zeros(2))]

    assert DataProto(Mapping()).batch["x"].tolist() == [0.0, 0.0]


def test_reorder_permutes_in_place():
    data = make_data()
    assert data.reorder(torch.tensor([2, 0, 3, 1])) is None
    assert column(data) == [6, 0, 9, 3]
    assert data.batch["mask"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert data.non_tensor_batch["uid"].tolist() == ["c", "a", "d", "b"]


def test_pad_to_divisor_cycles_rows_and_unpad_restores():
    padded, pad_size = pad_dataproto_to_divisor(make_data(), 3)
    assert pad_size == 2 and column(padded) == [0, 3, 6, 9, 0, 3]
    assert padded.non_tensor_batch["uid"].tolist() == ["a", "b", "c", "d", "a", "b"]
    assert column(unpad_dataproto(padded, pad_size)) == [0, 3, 6, 9]
    tiny, tiny_pad = pad_dataproto_to_divisor(make_data()[:2], 5)
    assert tiny_pad == 3 and column(tiny) == [0, 3, 0, 3, 0]
    data = make_data()
    assert pad_dataproto_to_divisor(data, 2) == (data, 0)
    assert unpad_dataproto(data, 0) is data
    with pytest.raises(ValueError, match=r"pad_size 5 is outside 0..4 rows"):
        unpad_dataproto(data, 5)


def test_make_iterator_is_reproducible_per_seed():
    data = DataProto({"i": torch.arange(6)})
    batches = list(data.make_iterator(mini_batch_size=2, epochs=2, seed=7))
    generator = torch.Generator().manual_seed(7)
    expected = torch.cat([torch.randperm(6, generator=generator), torch.randperm(6, generator=generator)])
    assert [batch.batch["i"].tolist() for batch in batches] == expected.view(6, 2).tolist()
    again = [batch.batch["i"].tolist() for batch in data.make_iterator(2, 2, seed=7)]
    assert again == [batch.batch["i"].tolist() for batch in batches]
    in_order = [batch.batch["i"].tolist() for batch in data.make_iterator(3, epochs=2, shuffle=False)]
    assert in_order == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="6 rows do not split into mini-batches of 4"):
        data.make_iterator(mini_batch_size=4, epochs=1)


# --------------------------------------------------------------------------------------------------
# devices, copies, files


def test_to_moves_in_place_and_chains():
    data = make_data()
    assert data.to("cpu") is data
    assert data.batch["x"].device.type == "cpu"


def test_pickle_round_trip_keeps_dtypes_shapes_and_values():
    grad = torch.ones(2, 2, requires_grad=True) * 2
    transposed = torch.arange(6, dtype=torch.float64).reshape(2, 3).t()  # not contiguous
    data = DataProto.from_dict({"bf16": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16).repeat(3, 1),
                                "bool": torch.tensor([True, False, True]), "empty": torch.zeros(3, 0),
                                "t": transposed},
                               {"gt": [{"a": 1}, [2], "c"]}, {"metrics": {"loss": [0.5]}})
    loaded = pickle.loads(pickle.dumps(data))
    for key, value in data.batch.items():
        assert loaded.batch[key].dtype == value.dtype and torch.equal(loaded.batch[key], value), key
    assert loaded.non_tensor_batch["gt"].tolist() == [{"a": 1}, [2], "c"]
    assert loaded.meta_info == {"metrics": {"loss": [0.5]}}
    assert torch.equal(pickle.loads(pickle.dumps(DataProto({"g": grad}))).batch["g"], torch.full((2, 2), 2.0))
    deep = copy.deepcopy(data)
    deep.batch["t"][0, 0] = 9
    assert data.batch["t"][0, 0].item() == 0.0


def test_save_and_load_from_disk(tmp_path):
    data = make_data()
    path = tmp_path / "batch.pkl"
    data.save_to_disk(str(path))
    loaded = DataProto.load_from_disk(str(path))
    assert torch.equal(loaded.batch["x"], data.batch["x"]) and loaded.batch["x"].dtype == torch.int64
    assert loaded.non_tensor_batch["uid"].tolist() == ["a", "b", "c", "d"]
    assert loaded.meta_info == {"temperature": 0.7}
    other = tmp_path / "other.pkl"
    other.write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(TypeError, match=r"other.pkl holds a dict, expected a DataProto"):
        DataProto.load_from_disk(str(other))


# --------------------------------------------------------------------------------------------------
# through Ray: how many copies

ROWS = 8 * 2 ** 20  # int64 rows: 64 MiB, far above Ray's inline-argument limit, far below the store size
NUM_BYTES = ROWS * 8


def _peak_memory_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def _reset_peak_memory() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # Linux: restart the peak-RSS (VmHWM) count from the current RSS


@ray.remote(num_cpus=0)
class TransferProbe:
    """A fresh process that measures its own peak memory around one ray.get or ray.put."""

    def get(self, wrapped_ref: list) -> dict:
        ray.get(ray.put(DataProto({"warm": torch.zeros(1)})))  # first-use costs outside the measurement
        _reset_peak_memory()
        before = _peak_memory_bytes()
        data = ray.get(wrapped_ref[0])
        peak = _peak_memory_bytes() - before
        values = data.batch["x"]
        report = {"peak": peak, "sum": values.sum().item(), "last": values[-1].item()}
        values += 1  # a private copy: the object store keeps the original
        report["sum_after_second_get"] = ray.get(wrapped_ref[0]).batch["x"].sum().item()
        return report

    def put(self) -> tuple[int, list]:
        data = DataProto({"x": torch.arange(ROWS)})
        ray.get(ray.put(DataProto({"warm": torch.zeros(1)})))
        _reset_peak_memory()
        before = _peak_memory_bytes()
        ref = ray.put(data)
        return _peak_memory_bytes() - before, [ref]


def test_ray_get_and_put_copy_tensor_bytes_once(ray_local):
    """Peak memory of a fresh process, in units of the tensor size N. A get maps the stored object (N,
    shared pages) and makes one private copy (N): ~2N; each extra copy would add N (plain torch
    tensors measure ~3N here). A put writes the bytes straight into the store: ~1N (plain tensors ~2N)."""
    probe = TransferProbe.remote()
    ref = ray.put(DataProto({"x": torch.arange(ROWS)}, meta_info={"step": 1}))
    report = ray.get(probe.get.remote([ref]))
    expected_sum = ROWS * (ROWS - 1) // 2
    assert report["sum"] == expected_sum and report["last"] == ROWS - 1
    assert report["sum_after_second_get"] == expected_sum
    assert 1.5 * NUM_BYTES < report["peak"] < 2.5 * NUM_BYTES, report["peak"] / NUM_BYTES

    put_peak, [put_ref] = ray.get(probe.put.remote())
    assert put_peak < 1.5 * NUM_BYTES, put_peak / NUM_BYTES
    assert ray.get(put_ref).batch["x"].sum().item() == expected_sum
    ray.kill(probe)
