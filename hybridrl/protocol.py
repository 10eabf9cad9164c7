"""DataProto: the one batch type that crosses process boundaries.

A DataProto carries three things that travel together between the controller and the workers:

- ``batch``: a plain dict of tensors that share their first (row) dimension,
- ``non_tensor_batch``: a dict of numpy arrays (usually ``dtype=object``) with one entry per row,
- ``meta_info``: a dict for everything that is not per row (temperature, metrics, flags).

Method names and semantics follow verl's DataProto so that users' custom code (reward managers,
filters) ports unchanged. Operations that produce a new DataProto give it a shallow copy of
``meta_info``; ``DataProto.concat`` keeps the first item's ``meta_info`` and merges ``metrics``.

Pickling (Ray, ``save_to_disk``) packs every tensor as a flat numpy byte view of its memory. Ray
ships such arrays out of band: the bytes go straight from the tensor into the object store (one
copy) and come back as one copy out of the read-only object store into a private, writable tensor.
Tensors always arrive on the CPU; the receiver moves them with ``.to(device)``.

Why ``batch`` is a dict and not verl's ``tensordict.TensorDict`` (issue 57, decided 2026-12-06). Measured with
benchmarks/dataproto_tensordict.py on a PPO batch of 1024 rows x 4096 tokens (12 keys, 176 MiB), on the 2-core CPU
machine shared with other jobs (so each op's median of 5-9 runs, ours and tensordict's in turn; 3 runs of it):
- the copying operations cost the same, they are memory bound: concat of 8 parts 281 vs 255 ms alone (the
  benchmark's own runs scattered from 0.28x to 0.90x as the machine's load moved), index by a permutation 82-447
  vs 154-452 ms (tensordict 1.0-1.9x ours);
- the per-call operations differ by fractions of a millisecond: chunk into 8 0.22-0.36 vs 0.14-0.16 ms and split into
  16 0.41-1.07 vs 0.24-0.25 ms (our constructor checks every part's row counts), select 8 vs 5-7 us, to('cpu') 7-15 vs
  19-35 us;
- through Ray, to an actor and back: our flat byte views 590 / 1096 ms, verl's default (consolidate + torch.save)
  1774 / 2217 ms, TensorDict's own pickling 1203 / 2339 ms; adopting TensorDict would keep our pickling;
- it would delete about 25 lines here (the row-count check, the per-key loops of take/concat/to), not the
  non-tensor handling, the pickling or the checks with our messages; it adds an 8 MiB package (and pyvers) and about
  2 s of import to every process that loads this module (Ray workers included; -X importtime, torch's own is 2.3 s);
- iterating a TensorDict yields rows, not keys: ``for key in data.batch`` and ``sorted(data.batch)`` (3 places in
  hybridrl, more in tests) would change meaning without an error.
So hybridrl keeps the dict, and the verl compat layer holds a TensorDict: hybridrl.compat.verl.protocol.DataProto is
this class with a TensorDict batch (every method here works on either, see _as_batch), which verl's own protocol
test passes (tests/test_verl_unit_tests.py). What that leaves open: a verl reward manager or filter handed one of
hybridrl's DataProtos (not one it built) finds a dict, so a TensorDict method on it (``batch.batch_size``) fails.
"""
from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

__all__ = ["DataProto", "DataProtoItem", "pad_dataproto_to_divisor", "unpad_dataproto"]


@dataclass
class DataProtoItem:
    """One row, ``data[i]``: tensors are views of row i, non-tensor values are the stored objects."""

    batch: dict[str, torch.Tensor]
    non_tensor_batch: dict[str, Any]
    meta_info: dict


class DataProto:
    def __init__(self, batch: dict[str, torch.Tensor] | None = None,
                 non_tensor_batch: dict[str, np.ndarray] | None = None, meta_info: dict | None = None):
        self.non_tensor_batch = dict(non_tensor_batch or {})
        self.meta_info = dict(meta_info or {})
        self.batch = self._as_batch({} if batch is None else batch)
        self.check_consistency()

    def _as_batch(self, tensors) -> dict[str, torch.Tensor]:
        """The container ``batch`` is held in, from any mapping of tensors (a dict, verl's TensorDict): a dict here.
        The verl compat DataProto (hybridrl.compat.verl.protocol) holds a TensorDict instead; every method below
        uses only what both share (``items``, ``keys``, ``[key]``, ``del``, ``in``), never ``len`` or iteration."""
        return {key: value for key, value in tensors.items()}

    # ----------------------------------------------------------------------------------------------
    # construction and checks

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None, non_tensors: dict | None = None,
                  meta_info: dict | None = None) -> DataProto:
        """Build from tensors and per-row values; lists become 1-d object arrays (one entry per row)."""
        non_tensor_batch = {key: _as_row_array(key, value) for key, value in (non_tensors or {}).items()}
        return cls(tensors, non_tensor_batch, meta_info)

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
        """Build from one dict, sorting values by type: tensors to ``batch``, arrays and lists to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list)):
                non_tensors[key] = value
            else:
                raise TypeError(f"from_single_dict: data[{key!r}] is a {type(value).__name__}; "
                                f"expected a torch.Tensor, numpy array or list (put scalars in meta_info)")
        return cls.from_dict(tensors, non_tensors, meta_info)

    def check_consistency(self) -> None:
        """Raise if a value has the wrong type or the row counts differ (the error lists every length)."""
        lengths = {}
        for key, value in self.batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"DataProto batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
            if value.dim() == 0:
                raise ValueError(f"DataProto batch[{key!r}] is a 0-d tensor; rows need a first dimension "
                                 f"(put scalars in meta_info)")
            lengths[f"batch[{key!r}]"] = value.shape[0]
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray) or value.ndim == 0:
                raise TypeError(f"DataProto non_tensor_batch[{key!r}] must be a numpy array with one entry per "
                                f"row, got {type(value).__name__} (DataProto.from_dict converts lists)")
            lengths[f"non_tensor_batch[{key!r}]"] = len(value)
        if len(set(lengths.values())) > 1:
            counts = ", ".join(f"{name} has {length}" for name, length in lengths.items())
            raise ValueError(f"DataProto rows differ in length: {counts}; every entry needs the same first dimension")

    def __len__(self) -> int:
        for value in self.batch.values():
            return value.shape[0]
        for value in self.non_tensor_batch.values():
            return len(value)
        return 0

    def __repr__(self) -> str:
        tensors = {key: f"{tuple(value.shape)} {value.dtype}" for key, value in self.batch.items()}
        return (f"DataProto(len={len(self)}, batch={tensors}, non_tensor_batch={list(self.non_tensor_batch)}, "
                f"meta_info={list(self.meta_info)})")

    # ----------------------------------------------------------------------------------------------
    # rows

    def __getitem__(self, item) -> DataProto | DataProtoItem:
        """``data[i]`` -> DataProtoItem (row views, as verl); a slice, list, array or tensor of indices -> DataProto."""
        if isinstance(item, (int, np.integer)):
            if not -len(self) <= item < len(self):
                raise IndexError(f"DataProto index {item} is out of range for {len(self)} rows")
            return DataProtoItem({key: value[item] for key, value in self.batch.items()},
                                 {key: value[item] for key, value in self.non_tensor_batch.items()},
                                 self.meta_info)
        if isinstance(item, slice):
            return self._take_rows(item)
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self._take_rows(self._row_indices(item))
        raise TypeError(f"DataProto indices must be int, slice, list, numpy array or tensor, got {type(item).__name__}")

    def _row_indices(self, item) -> np.ndarray:
        indices = np.asarray(item.cpu() if isinstance(item, torch.Tensor) else item)
        if indices.dtype == bool:
            if indices.shape != (len(self),):
                raise IndexError(f"DataProto boolean mask has shape {indices.shape}, expected ({len(self)},)")
            return np.flatnonzero(indices)
        if indices.size and not np.issubdtype(indices.dtype, np.integer):
            raise TypeError(f"DataProto index array must hold integers or booleans, got dtype {indices.dtype}")
        indices = indices.astype(np.int64).reshape(-1)
        outside = indices[(indices < -len(self)) | (indices >= len(self))]
        if outside.size:
            raise IndexError(f"DataProto index {outside[0]} is out of range for {len(self)} rows")
        return np.where(indices < 0, indices + len(self), indices)

    def _take_rows(self, rows: slice | np.ndarray) -> DataProto:
        """The rows a slice (views) or an array of row indices in range (copies) names."""
        if isinstance(rows, slice):
            tensors = {key: value[rows] for key, value in self.batch.items()}
        else:
            tensor_rows = torch.from_numpy(rows)
            tensors = {key: _take_tensor_rows(value, tensor_rows) for key, value in self.batch.items()}
        return type(self)(tensors, {key: value[rows] for key, value in self.non_tensor_batch.items()}, self.meta_info)

    def select(self, batch_keys: list[str] | None = None, non_tensor_batch_keys: list[str] | None = None,
               meta_info_keys: list[str] | None = None, deepcopy: bool = False) -> DataProto:
        """A DataProto with only the named keys (None keeps every key of that part); shares tensors unless deepcopy."""
        selected = type(self)(_pick(self.batch, batch_keys, "batch"),
                              _pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch"),
                              _pick(self.meta_info, meta_info_keys, "meta_info"))
        return copy.deepcopy(selected) if deepcopy else selected

    def pop(self, batch_keys: list[str] | None = None, non_tensor_batch_keys: list[str] | None = None,
            meta_info_keys: list[str] | None = None) -> DataProto:
        """Remove the named keys (None removes nothing) and return them as a new DataProto."""
        popped = self.select(batch_keys or [], non_tensor_batch_keys or [], meta_info_keys or [])
        for part, keys in ((self.batch, popped.batch), (self.non_tensor_batch, popped.non_tensor_batch),
                           (self.meta_info, popped.meta_info)):
            for key in list(keys.keys()):
                del part[key]
        return popped

    def select_idxs(self, idxs: list | np.ndarray | torch.Tensor) -> DataProto:
        """verl's name for ``data[idxs]``: the rows at these indices, or where a boolean mask is True."""
        return self._take_rows(self._row_indices(idxs))

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """verl's name for ``data[start:end:step]``."""
        return self._take_rows(slice(start, end, step))

    def rename(self, old_keys: str | list[str], new_keys: str | list[str]) -> DataProto:
        """Rename batch keys in place (returns self); each old key must exist and no new key may."""
        old_keys, new_keys = ([old_keys] if isinstance(old_keys, str) else list(old_keys),
                              [new_keys] if isinstance(new_keys, str) else list(new_keys))
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename: {len(old_keys)} old keys {old_keys} but {len(new_keys)} new keys {new_keys}")
        missing = [key for key in old_keys if key not in self.batch]
        taken = [key for key in new_keys if key in self.batch and key not in old_keys]
        if missing or taken:
            raise KeyError(f"rename: batch has no key(s) {missing} / already has key(s) {taken}; "
                           f"it has {sorted(self.batch.keys())}")
        tensors = {key: self.batch[key] for key in old_keys}
        for key in old_keys:
            del self.batch[key]
        for old_key, new_key in zip(old_keys, new_keys):
            self.batch[new_key] = tensors[old_key]
        return self

    def union(self, other: DataProto) -> DataProto:
        """Add other's keys to self (in place, returns self). A key present in both must hold equal values, except
        meta_info["metrics"] (each worker call's own report), whose keys are merged, other's winning."""
        if _has_rows(self) and _has_rows(other) and len(self) != len(other):
            raise ValueError(f"union: DataProtos have {len(self)} and {len(other)} rows; they must be equal")
        for part, other_part, name in ((self.batch, other.batch, "batch"),
                                       (self.non_tensor_batch, other.non_tensor_batch, "non_tensor_batch"),
                                       (self.meta_info, other.meta_info, "meta_info")):
            for key, value in other_part.items():
                if part is self.meta_info and key == "metrics" and isinstance(value, dict):
                    part[key] = {**part.get(key, {}), **value}
                    continue
                if key in part and not _values_equal(part[key], value):
                    raise ValueError(f"union: {name}[{key!r}] holds different values in the two DataProtos")
                part[key] = value
        return self

    # ----------------------------------------------------------------------------------------------
    # splitting and joining

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal parts (row views); the row count must divide."""
        if chunks <= 0 or len(self) % chunks:
            raise ValueError(f"chunk: {len(self)} rows do not split into {chunks} equal chunks")
        size = len(self) // chunks
        return [self[index * size:(index + 1) * size] for index in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into parts of ``split_size`` rows; the last part holds the remainder."""
        if split_size <= 0:
            raise ValueError(f"split: split_size must be a positive int, got {split_size}")
        return [self[start:start + split_size] for start in range(0, len(self), split_size)]

    @staticmethod
    def concat(data: list[DataProto]) -> DataProto:
        """Join along rows. meta_info is the first item's, except ``metrics``: each key collects the values of
        every item into one list (scalars become one entry, lists are extended), ready for a mean on the controller."""
        if not data:
            raise ValueError("concat: needs at least one DataProto")
        first = data[0]
        for index, item in enumerate(data[1:], start=1):
            if (set(item.batch.keys()) != set(first.batch.keys())
                    or item.non_tensor_batch.keys() != first.non_tensor_batch.keys()):
                raise ValueError(f"concat: item {index} has keys {sorted(item.batch.keys())} + "
                                 f"{sorted(item.non_tensor_batch)}, item 0 has {sorted(first.batch.keys())} + "
                                 f"{sorted(first.non_tensor_batch)}")
        return type(first)({key: torch.cat([item.batch[key] for item in data]) for key in first.batch.keys()},
                           {key: np.concatenate([item.non_tensor_batch[key] for item in data])
                            for key in first.non_tensor_batch},
                           type(first).concat_meta_info(data))

    @staticmethod
    def concat_meta_info(data: list[DataProto]) -> dict:
        """concat's meta_info: the first item's (ranks may differ in per-rank values, such as timings), with
        ``metrics`` collected from every item (see concat)."""
        meta_info = dict(data[0].meta_info)
        if any("metrics" in item.meta_info for item in data):
            meta_info["metrics"] = _merge_metrics(data)
        return meta_info

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row: interleave gives a,a,b,b (one group per prompt, as rollout.n); otherwise a,b,a,b."""
        rows = np.arange(len(self))
        rows = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self._take_rows(rows)

    def sample_level_repeat(self, repeat_times: list[int] | tuple[int, ...] | np.ndarray | torch.Tensor) -> DataProto:
        """Repeat row i ``repeat_times[i]`` times, in row order (a,a,a,b,c,c for [3, 1, 2])."""
        counts = np.asarray(repeat_times.cpu() if isinstance(repeat_times, torch.Tensor) else repeat_times)
        if counts.shape != (len(self),) or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
            raise ValueError(f"sample_level_repeat: repeat_times must hold one count >= 0 per row ({len(self)} "
                             f"rows), got {counts.tolist()}")
        return self._take_rows(np.repeat(np.arange(len(self)), counts))

    def unfold_column_chunks(self, n_split: int, split_keys: list[str] | None = None) -> DataProto:
        """Each row becomes ``n_split`` rows: the keys in ``split_keys`` are cut along their second dimension into
        n_split pieces (one per new row), every other key is repeated (verl's unfold_column_chunks)."""
        split_keys = set(split_keys or [])
        return type(self)(
            {key: _unfold_column(f"batch[{key!r}]", value, n_split, key in split_keys)
             for key, value in self.batch.items()},
            {key: _unfold_column(f"non_tensor_batch[{key!r}]", value, n_split, key in split_keys)
             for key, value in self.non_tensor_batch.items()},
            self.meta_info)

    def reorder(self, indices: torch.Tensor | np.ndarray | list[int]) -> None:
        """Permute the rows in place: row i becomes old row ``indices[i]``."""
        reordered = self[indices]
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch

    def make_iterator(self, mini_batch_size: int, epochs: int, seed: int | None = None,
                      shuffle: bool = True) -> Iterator[DataProto]:
        """Yield mini-batches for ``epochs`` passes, reshuffled each pass. A seed makes the order reproducible;
        seed=None draws the order from torch's global RNG."""
        if mini_batch_size <= 0 or len(self) % mini_batch_size:
            raise ValueError(f"make_iterator: {len(self)} rows do not split into mini-batches of {mini_batch_size}")
        if epochs <= 0:
            raise ValueError(f"make_iterator: epochs must be a positive int, got {epochs}")
        generator = None if seed is None else torch.Generator().manual_seed(seed)

        def mini_batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                order = torch.randperm(len(self), generator=generator) if shuffle else torch.arange(len(self))
                yield from self[order].split(mini_batch_size)

        return mini_batches()

    # ----------------------------------------------------------------------------------------------
    # devices, copies, files

    def to(self, device: str | torch.device) -> DataProto:
        """Move every tensor to ``device`` in place; returns self so calls chain."""
        self.batch = self._as_batch({key: value.to(device) for key, value in self.batch.items()})
        return self

    def __deepcopy__(self, memo: dict) -> DataProto:
        # Written out because the pickling state moves tensors to the CPU; a deep copy keeps their device.
        return type(self)({key: value.clone() for key, value in self.batch.items()},
                         copy.deepcopy(self.non_tensor_batch, memo), copy.deepcopy(self.meta_info, memo))

    def __getstate__(self) -> dict:
        return {"batch": {key: _pack_tensor(value) for key, value in self.batch.items()},
                "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict) -> None:
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
        self.batch = self._as_batch({key: _unpack_tensor(*packed) for key, packed in state["batch"].items()})

    def save_to_disk(self, path: str) -> None:
        """Write with pickle (tensors land on the CPU). Load only files you trust: unpickling runs code."""
        with open(path, "wb") as file:
            pickle.dump(self, file, protocol=pickle.HIGHEST_PROTOCOL)

    @staticmethod
    def load_from_disk(path: str) -> DataProto:
        with open(path, "rb") as file:
            data = pickle.load(file)
        if not isinstance(data, DataProto):
            raise TypeError(f"load_from_disk: {path} holds a {type(data).__name__}, expected a DataProto")
        return data


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """Append copies of the first rows (cycling) until the row count divides; returns (padded, pad_size)."""
    if size_divisor <= 0:
        raise ValueError(f"pad_dataproto_to_divisor: size_divisor must be a positive int, got {size_divisor}")
    pad_size = -len(data) % size_divisor
    if pad_size == 0:
        return data, 0
    rows = np.concatenate([np.arange(len(data)), np.arange(pad_size) % len(data)])
    return data[rows], pad_size


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """Drop the ``pad_size`` rows that pad_dataproto_to_divisor appended."""
    if not 0 <= pad_size <= len(data):
        raise ValueError(f"unpad_dataproto: pad_size {pad_size} is outside 0..{len(data)} rows")
    return data[:len(data) - pad_size] if pad_size else data


# --------------------------------------------------------------------------------------------------
# helpers


def _as_row_array(key: str, value) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"non_tensors[{key!r}] must be a list or numpy array, got {type(value).__name__}")
    rows = np.empty(len(value), dtype=object)  # filled one by one so nested lists stay one object per row
    for index, element in enumerate(value):
        rows[index] = element
    return rows


def _unfold_column(name: str, value: torch.Tensor | np.ndarray, n_split: int, split: bool) -> torch.Tensor | np.ndarray:
    """unfold_column_chunks for one entry: rows (rows, k, ...) -> (rows * n_split, k / n_split, ...), or each row
    repeated n_split times."""
    if not split:
        return (value.repeat_interleave(n_split, dim=0) if isinstance(value, torch.Tensor)
                else np.repeat(value, n_split, axis=0))
    if value.ndim < 2 or value.shape[1] % n_split:
        raise ValueError(f"unfold_column_chunks: {name} has shape {tuple(value.shape)}; its second dimension must "
                         f"split into {n_split} equal pieces")
    return value.reshape(value.shape[0] * n_split, value.shape[1] // n_split, *value.shape[2:])


def _take_tensor_rows(value, rows: torch.Tensor):
    """value[rows] for in-range row indices. A tensor's index_select gives the same rows as value[rows] does, but
    15-1000x faster on a small batch on the CPU (128 x 58 int64: 0.04 against 2.7 ms with 2 threads, 0.007 against
    0.16 ms with one), where advanced indexing's set-up outweighs the copy; a batch's entry that is no tensor (a
    nested TensorDict in the verl compat DataProto) is indexed as before."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, rows.to(value.device))
    return value[rows]


def _pick(part: dict, keys: list[str] | None, name: str) -> dict:
    if keys is None:
        return dict(part.items())
    missing = [key for key in keys if key not in part]
    if missing:
        raise KeyError(f"DataProto {name} has no key(s) {missing}; available: {sorted(part.keys())}")
    return {key: part[key] for key in keys}


def _has_rows(data: DataProto) -> bool:
    return bool(data.batch.keys() or data.non_tensor_batch)


def _values_equal(first, second) -> bool:
    if first is second:
        return True
    if isinstance(first, torch.Tensor) or isinstance(second, torch.Tensor):
        return (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and first.dtype == second.dtype
                and first.shape == second.shape and bool(torch.equal(first.cpu(), second.cpu())))
    if isinstance(first, np.ndarray) or isinstance(second, np.ndarray):
        if not (isinstance(first, np.ndarray) and isinstance(second, np.ndarray) and first.shape == second.shape):
            return False
        if first.dtype == object or second.dtype == object:
            return all(_values_equal(a, b) for a, b in zip(first.ravel(), second.ravel()))
        return bool(np.array_equal(first, second))
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_values_equal(first[key], second[key]) for key in first)
    if isinstance(first, (list, tuple)) and isinstance(second, (list, tuple)):
        return len(first) == len(second) and all(_values_equal(a, b) for a, b in zip(first, second))
    return bool(first == second)


def _merge_metrics(data: list[DataProto]) -> dict[str, list]:
    merged: dict[str, list] = {}
    for index, item in enumerate(data):
        metrics = item.meta_info.get("metrics", {})
        if not isinstance(metrics, dict):
            raise TypeError(f"concat: item {index} meta_info['metrics'] is a {type(metrics).__name__}, expected a dict")
        for key, value in metrics.items():
            merged.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return merged


def _pack_tensor(tensor: torch.Tensor) -> tuple[np.ndarray, torch.dtype, tuple[int, ...]]:
    # A flat byte view of a contiguous tensor costs no copy here, and numpy arrays are what Ray's
    # serializer hands to the object store out of band (pickle protocol 5 buffers).
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape)


def _unpack_tensor(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data.flags.writeable:  # a view into Ray's shared object store: take the one private copy
        data = data.copy()
    return torch.from_numpy(data).view(dtype).reshape(shape)
