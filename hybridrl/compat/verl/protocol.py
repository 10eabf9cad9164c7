"""verl's `verl.protocol`: DataProto with its `batch` a `tensordict.TensorDict`, and the module's helpers.

hybridrl's own DataProto (hybridrl/protocol.py) holds its batch in a dict; verl's holds it in a TensorDict, and code
written against verl calls TensorDict's methods on it (`batch.batch_size`, `batch.select(...)`, `batch.view(...)`).
This DataProto is hybridrl's with a TensorDict for a batch: every method is hybridrl's, and where verl's contract
differs it says so here:

- `from_dict` turns a list into `np.array(list, dtype=object)` as verl does (equal-length nested lists become a 2-d
  array, which `unfold_column_chunks` splits); hybridrl's keeps one object per row;
- `concat` merges every item's meta_info (a key two items hold with different values is refused) and collects
  `metrics` given as a dict or a list of dicts; hybridrl's keeps item 0's meta_info;
- verl's checks raise AssertionError (a chunk count that does not divide, num_batch_dims other than 1), as verl's do;
- the batch is always a TensorDict (empty when there are no tensors, with the row count as its batch size), never None.

Pickling is hybridrl's (each tensor a flat byte view, out of band through Ray), for either of verl's serialisation
methods (VERL_DATAPROTO_SERIALIZATION_METHOD); TensorDict.consolidate is never called.
"""
from __future__ import annotations

import numpy as np
import torch

try:
    from tensordict import NonTensorData, NonTensorStack, TensorDict
except ImportError as missing:
    raise ImportError("hybridrl.compat.verl.protocol needs tensordict, the type of verl's DataProto.batch: "
                      "pip install 'hybridrl[verl]'") from missing

from hybridrl.protocol import DataProto as _HybridDataProto
from hybridrl.protocol import DataProtoItem, _as_row_array, _pack_tensor, pad_dataproto_to_divisor, unpad_dataproto

__all__ = ["DataProto", "DataProtoItem", "union_tensor_dict", "union_numpy_dict", "fold_batch_dim", "unfold_batch_dim",
           "serialize_single_tensor", "deserialize_single_tensor", "serialize_tensordict", "deserialize_tensordict",
           "pad_dataproto_to_divisor", "unpad_dataproto"]


class DataProto(_HybridDataProto):
    batch: TensorDict

    def _as_batch(self, tensors) -> TensorDict:
        if isinstance(tensors, TensorDict):
            return tensors
        rows = _row_count(tensors, self.non_tensor_batch)
        return TensorDict(dict(tensors.items()), batch_size=[] if rows is None else [rows])

    def check_consistency(self) -> None:
        assert self.batch.batch_dims <= 1, (
            f"DataProto.batch has batch size {tuple(self.batch.batch_size)}: one batch dimension only "
            f"(fold_batch_dim's result is unfolded with unfold_batch_dim before other use)")
        super().check_consistency()

    def __len__(self) -> int:
        if self.batch.batch_dims:
            return self.batch.batch_size[0]
        return super().__len__()

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None, non_tensors: dict | None = None,
                  meta_info: dict | None = None, num_batch_dims: int = 1, auto_padding: bool = False) -> DataProto:
        assert num_batch_dims == 1, f"DataProto.from_dict: num_batch_dims={num_batch_dims}; only 1 is supported"
        if auto_padding:
            raise NotImplementedError("DataProto.from_dict(auto_padding=True): verl's auto padding is not supported "
                                      "here; pad with pad_dataproto_to_divisor and unpad with unpad_dataproto")
        non_tensors = {key: value if isinstance(value, np.ndarray) else np.array(value, dtype=object)
                       for key, value in (non_tensors or {}).items()}
        return super().from_dict(tensors, non_tensors, meta_info)

    @classmethod
    def from_single_dict(cls, data: dict, meta_info: dict | None = None, auto_padding: bool = False) -> DataProto:
        if auto_padding:
            return cls.from_dict(meta_info=meta_info, auto_padding=True)  # refused, with the reason
        return super().from_single_dict(data, meta_info)

    @classmethod
    def from_tensordict(cls, tensor_dict: TensorDict, meta_info: dict | None = None,
                        num_batch_dims: int = 1) -> DataProto:
        """The inverse of to_tensordict: tensors -> batch, per-row values (NonTensorStack) -> non_tensor_batch,
        single values (NonTensorData) -> meta_info."""
        assert num_batch_dims == 1, f"DataProto.from_tensordict: num_batch_dims={num_batch_dims}; only 1 is supported"
        tensors, non_tensors, meta_info = {}, {}, dict(meta_info or {})
        for key, value in tensor_dict.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, NonTensorStack):
                non_tensors[key] = _as_row_array(key, [row.data for row in value])
            elif isinstance(value, NonTensorData):
                meta_info[key] = value.data
            else:
                raise TypeError(f"DataProto.from_tensordict: tensor_dict[{key!r}] is a {type(value).__name__}; "
                                f"expected a tensor, NonTensorStack (per row) or NonTensorData (one value)")
        return cls(tensors, non_tensors, meta_info)

    def to_tensordict(self) -> TensorDict:
        """One TensorDict: tensors as they are, per-row values as NonTensorStacks, meta_info as NonTensorData."""
        from hybridrl.compat.verl.utils.tensordict_utils import get_tensordict

        shared = set(self.batch.keys()) & set(self.non_tensor_batch)
        assert not shared, f"DataProto.to_tensordict: keys {sorted(shared)} are in both batch and non_tensor_batch"
        columns = dict(self.batch.items())
        columns.update({key: NonTensorStack.from_list([NonTensorData(row) for row in value])
                        for key, value in self.non_tensor_batch.items()})
        return get_tensordict(columns, self.meta_info)

    def to(self, device: str | torch.device) -> DataProto:
        self.batch = self.batch.to(device)  # keeps an empty batch's batch size
        return self

    def chunk(self, chunks: int) -> list[DataProto]:
        assert chunks > 0 and len(self) % chunks == 0, (
            f"DataProto.chunk: {len(self)} rows do not split into {chunks} equal chunks")
        return super().chunk(chunks)

    @staticmethod
    def concat_meta_info(data: list[DataProto]) -> dict:
        """Every item's meta_info in one (a key held with two values is refused); ``metrics``, each item's dict or
        list of dicts, become one dict of lists."""
        merged, metrics = {}, []
        for item in data:
            for key, value in item.meta_info.items():
                if key != "metrics":
                    assert key not in merged or merged[key] == value, f"Conflicting values for meta_info key '{key}'"
                    merged[key] = value
                elif value is not None:
                    metrics.extend(value if isinstance(value, list) else [value])
        if metrics:
            merged["metrics"] = {}
            for report in metrics:
                for key, value in report.items():
                    merged["metrics"].setdefault(key, []).append(value)
        return merged

    def __getstate__(self) -> dict:
        return {**super().__getstate__(), "batch_size": tuple(self.batch.batch_size)}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.batch = TensorDict(dict(self.batch.items()), batch_size=state["batch_size"])


def _row_count(tensors, non_tensor_batch: dict) -> int | None:
    """The rows of a DataProto being built: the first tensor's, else the first per-row array's, else None."""
    for value in tensors.values():
        return value.shape[0]
    for value in non_tensor_batch.values():
        return len(value)
    return None



# ------------------------------------------------------------------------------------------------ unions


def union_tensor_dict(tensor_dict1: TensorDict, tensor_dict2: TensorDict) -> TensorDict:
    """Add tensor_dict2's tensors to tensor_dict1 (in place, returned); a key in both must hold equal tensors."""
    assert tensor_dict1.batch_size == tensor_dict2.batch_size, (
        f"union_tensor_dict: batch sizes differ, {tuple(tensor_dict1.batch_size)} and "
        f"{tuple(tensor_dict2.batch_size)}")
    for key, value in tensor_dict2.items():
        if key in tensor_dict1.keys():
            assert tensor_dict1[key].equal(value), f"{key} in tensor_dict1 and tensor_dict2 are not the same object"
        else:
            tensor_dict1[key] = value
    return tensor_dict1


def union_numpy_dict(tensor_dict1: dict[str, np.ndarray], tensor_dict2: dict[str, np.ndarray]) -> dict:
    """Add tensor_dict2's arrays to tensor_dict1 (in place, returned); a key in both must hold equal arrays, compared
    element by element into nested objects, NaN equal to NaN at the same place, cycles compared by their shape."""
    for key, value in tensor_dict2.items():
        if key in tensor_dict1:
            assert isinstance(value, np.ndarray) and isinstance(tensor_dict1[key], np.ndarray), (
                f"union_numpy_dict: `{key}` must be a numpy array in both dicts")
            assert _deep_equal(tensor_dict1[key], value, set()), (
                f"`{key}` in tensor_dict1 and tensor_dict2 are not the same object.")
        tensor_dict1[key] = value
    return tensor_dict1


def _deep_equal(first, second, visiting: set) -> bool:
    """Equal values: arrays and containers element-wise, NaN == NaN; a pair already being compared (a cycle) is
    equal."""
    pair = (id(first), id(second))
    if pair in visiting:
        return True
    if isinstance(first, np.ndarray) or isinstance(second, np.ndarray):
        if not (isinstance(first, np.ndarray) and isinstance(second, np.ndarray)) or first.shape != second.shape:
            return False
        if first.dtype != object and second.dtype != object:
            return bool(np.array_equal(first, second, equal_nan=first.dtype.kind in "fc"))
        visiting.add(pair)
        return all(_deep_equal(a, b, visiting) for a, b in zip(first.ravel(), second.ravel()))
    if isinstance(first, dict) and isinstance(second, dict):
        visiting.add(pair)
        return first.keys() == second.keys() and all(_deep_equal(first[key], second[key], visiting) for key in first)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        visiting.add(pair)
        return len(first) == len(second) and all(_deep_equal(a, b, visiting) for a, b in zip(first, second))
    if isinstance(first, float) and isinstance(second, float) and first != first and second != second:
        return True  # NaN at the same place
    return type(first) is type(second) and bool(first == second)


# ------------------------------------------------------------------------------------------------ batch dims


def fold_batch_dim(data: DataProto, new_batch_size: int) -> DataProto:
    """[rows, ...] -> [new_batch_size, rows // new_batch_size, ...] for every tensor and per-row array."""
    assert len(data) % new_batch_size == 0, f"fold_batch_dim: {len(data)} rows do not fold into {new_batch_size}"
    batch = data.batch.view(new_batch_size, -1)
    batch.auto_batch_size_(batch_dims=1)
    non_tensors = {key: value.reshape(new_batch_size, -1, *value.shape[1:])
                   for key, value in data.non_tensor_batch.items()}
    return type(data)(batch, non_tensors, data.meta_info)


def unfold_batch_dim(data: DataProto, batch_dims: int = 2) -> DataProto:
    """The first `batch_dims` dimensions of every tensor and per-row array become one row dimension."""
    batch = data.batch
    batch.auto_batch_size_(batch_dims=batch_dims)
    batch = batch.view(-1)
    non_tensors = {key: value.reshape(batch.batch_size[0], *value.shape[batch_dims:])
                   for key, value in data.non_tensor_batch.items()}
    return type(data)(batch, non_tensors, data.meta_info)


# ------------------------------------------------------------------------------------------------ serialisation


def serialize_single_tensor(tensor: torch.Tensor) -> tuple[str, torch.Size, np.ndarray]:
    """(dtype name, shape, the bytes as a flat uint8 numpy view): numpy arrays go through Ray out of band."""
    data, dtype, _ = _pack_tensor(tensor)
    return str(dtype).removeprefix("torch."), tensor.shape, data


def deserialize_single_tensor(encoded: tuple[str, tuple[int, ...], object]) -> torch.Tensor:
    """The tensor serialize_single_tensor encoded, in writable memory of its own."""
    dtype_name, shape, data = encoded
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"deserialize_single_tensor: {dtype_name!r} is not a torch dtype")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def serialize_tensordict(batch: TensorDict) -> tuple[tuple[int, ...], str | None, dict[str, tuple]]:
    """(batch size, device, {key: encoded tensor}); a nested tensor is (layout name, [its tensors encoded])."""
    encoded = {}
    for key, value in batch.items():
        if value.is_nested:
            encoded[key] = (str(value.layout).removeprefix("torch."),
                            [serialize_single_tensor(part) for part in value.unbind()])
        else:
            encoded[key] = serialize_single_tensor(value)
    return tuple(batch.batch_size), None if batch.device is None else str(batch.device), encoded


def deserialize_tensordict(encoded: tuple) -> TensorDict:
    batch_size, device, items = encoded
    tensors = {}
    for key, value in items.items():
        if len(value) == 3:
            tensors[key] = deserialize_single_tensor(value)
        elif len(value) == 2:
            layout, parts = value
            tensors[key] = torch.nested.as_nested_tensor([deserialize_single_tensor(part) for part in parts],
                                                         layout=getattr(torch, layout))
        else:
            raise ValueError(f"deserialize_tensordict: item {key!r} has {len(value)} fields; expected 3 (a tensor) "
                             f"or 2 (a nested tensor)")
    return TensorDict(tensors, batch_size=batch_size, device=device)
