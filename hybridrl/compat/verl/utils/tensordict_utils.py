"""verl's `verl.utils.tensordict_utils`, the part verl's protocol uses: one TensorDict from tensors, per-row values
and single values.

A per-row value (a list or numpy array, one entry per row, entries of any shape: lists of varying length, dicts)
becomes a NonTensorStack of NonTensorData, so nested entries stay one object per row; a single value becomes
NonTensorData. verl's other TensorDict helpers (index_select_tensor_dict, concat_tensordict, chunk_tensordict, ...)
are not mirrored: TensorDict's own methods do what they do.
"""
from __future__ import annotations

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

__all__ = ["get_tensordict", "assign_non_tensor"]


def get_tensordict(tensor_dict: dict[str, torch.Tensor | list | np.ndarray | NonTensorStack],
                   non_tensor_dict: dict | None = None) -> TensorDict:
    """A TensorDict of `tensor_dict`'s columns (one row dimension, the same length for all) and `non_tensor_dict`'s
    single values."""
    columns, rows = {}, None
    for key, value in tensor_dict.items():
        columns[key] = _column(key, value)
        length = len(value) if not isinstance(value, torch.Tensor) else value.shape[0]
        if rows is not None and length != rows:
            raise ValueError(f"get_tensordict: tensor_dict[{key!r}] has {length} rows, the keys before it {rows}")
        rows = length
    for key, value in (non_tensor_dict or {}).items():
        if key in columns:
            raise ValueError(f"get_tensordict: {key!r} is both a column (tensor_dict) and a single value "
                             f"(non_tensor_dict)")
        columns[key] = NonTensorData(value)
    return TensorDict(columns, batch_size=[] if rows is None else [rows])


def assign_non_tensor(tensor_dict: TensorDict, **values) -> TensorDict:
    """Store each value in `tensor_dict` (in place, returned): a list per row as a NonTensorStack, anything else as
    one NonTensorData."""
    for key, value in values.items():
        if isinstance(value, (NonTensorData, NonTensorStack)):
            tensor_dict[key] = value
        elif isinstance(value, list):
            tensor_dict[key] = _column(key, value)
        else:
            tensor_dict[key] = NonTensorData(value)
    return tensor_dict


def _column(key: str, value) -> torch.Tensor | NonTensorStack:
    if isinstance(value, torch.Tensor):
        if value.is_nested and value.layout != torch.jagged:
            raise ValueError(f"get_tensordict: tensor_dict[{key!r}] is a nested tensor of layout {value.layout}; "
                             f"only torch.jagged is supported")
        return value
    if isinstance(value, NonTensorStack):
        return value
    if not isinstance(value, (list, np.ndarray)):
        raise TypeError(f"get_tensordict: tensor_dict[{key!r}] is a {type(value).__name__}; expected a tensor, list, "
                        f"numpy array or NonTensorStack")
    if any(isinstance(row, torch.Tensor) for row in value):
        raise TypeError(f"get_tensordict: tensor_dict[{key!r}] is a list holding tensors; stack them into one tensor "
                        f"or convert them to numpy")
    return NonTensorStack.from_list([NonTensorData(row) for row in value])
