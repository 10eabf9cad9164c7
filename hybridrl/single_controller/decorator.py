"""@register: how a worker method's call on the group is spread over the ranks and gathered back.

A registered method is written for one rank. The worker group turns one call on the controller
into one call per rank (the dispatch mode says which arguments each rank gets), runs them (the
execute mode says on which ranks) and gathers the per-rank results into one value:

- ONE_TO_ALL: every rank gets the same arguments; returns the list of per-rank results.
- ALL_TO_ALL: every argument is a list with one entry per rank; returns the list of results.
- RANK_ZERO: only rank 0 runs; returns its result.
- DP_COMPUTE: as ALL_TO_ALL; names the data-parallel use (every rank is a data-parallel rank here).
- DP_COMPUTE_PROTO: every DataProto argument is split into world_size equal chunks (other
  arguments go to every rank unchanged); the DataProto results are concatenated in rank order.
  A batch that does not divide is padded with copies of its first rows and the padding is
  removed from the result, so callers never see it (an update method does train on the copies).
  The result keeps rank 0's meta_info, with ``metrics`` merged over ranks by DataProto.concat.

Execute.RANK_ZERO runs a ONE_TO_ALL method on rank 0 only and returns rank 0's result.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from hybridrl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

REGISTER_ATTRIBUTE = "_hybridrl_registered"


class Dispatch(Enum):
    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    RANK_ZERO = "rank_zero"
    DP_COMPUTE = "dp_compute"
    DP_COMPUTE_PROTO = "dp_compute_proto"


class Execute(Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class Registration:
    """What @register recorded on a method."""

    dispatch_mode: Dispatch
    execute_mode: Execute
    blocking: bool


def register(dispatch_mode: Dispatch = Dispatch.ALL_TO_ALL, execute_mode: Execute = Execute.ALL,
             blocking: bool = True) -> Callable:
    """Mark a worker method to be bound on its RayWorkerGroup. blocking=False makes the group call
    return a WorkerGroupFuture instead of waiting."""
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"register: dispatch_mode must be a Dispatch, got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"register: execute_mode must be an Execute, got {execute_mode!r}")
    if execute_mode is Execute.RANK_ZERO and dispatch_mode not in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        raise ValueError(f"register: Execute.RANK_ZERO runs one rank, so it needs Dispatch.ONE_TO_ALL or "
                         f"Dispatch.RANK_ZERO, got {dispatch_mode}")
    registration = Registration(dispatch_mode, execute_mode, blocking)

    def mark(method: Callable) -> Callable:
        setattr(method, REGISTER_ATTRIBUTE, registration)
        return method

    return mark


def registered_methods(cls: type) -> dict[str, Registration]:
    """Every @register-ed method of ``cls`` (inherited ones included), by name."""
    methods = {}
    for name in dir(cls):
        registration = getattr(getattr(cls, name, None), REGISTER_ATTRIBUTE, None)
        if registration is not None:
            methods[name] = registration
    return methods


@dataclass
class PlannedCall:
    """One group call, planned: the arguments of each rank that runs, in rank order, and how to gather."""

    rank_arguments: list[tuple[tuple, dict]]
    collect: Callable[[list], Any]


def plan_call(registration: Registration, world_size: int, method_name: str, args: tuple,
              kwargs: dict) -> PlannedCall:
    planned = _PLANNERS[registration.dispatch_mode](world_size, method_name, args, kwargs)
    if registration.execute_mode is Execute.RANK_ZERO:
        return PlannedCall(planned.rank_arguments[:1], _rank_zero_result)
    return planned


def _rank_zero_result(outputs: list) -> Any:
    return outputs[0]


def _plan_one_to_all(world_size: int, method_name: str, args: tuple, kwargs: dict) -> PlannedCall:
    return PlannedCall([(args, kwargs)] * world_size, list)


def _plan_rank_zero(world_size: int, method_name: str, args: tuple, kwargs: dict) -> PlannedCall:
    return PlannedCall([(args, kwargs)], _rank_zero_result)


def _plan_all_to_all(world_size: int, method_name: str, args: tuple, kwargs: dict) -> PlannedCall:
    named = {f"argument {index}": value for index, value in enumerate(args)} | {f"argument {key!r}": value
                                                                             for key, value in kwargs.items()}
    for name, value in named.items():
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            got = f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{method_name}: {name} must be a list with one entry per rank "
                             f"({world_size}), got {got}")
    return PlannedCall([(tuple(value[rank] for value in args), {key: value[rank] for key, value in kwargs.items()})
                        for rank in range(world_size)], list)


def _plan_dp_compute_proto(world_size: int, method_name: str, args: tuple, kwargs: dict) -> PlannedCall:
    lengths = {len(value) for value in (*args, *kwargs.values()) if isinstance(value, DataProto)}
    if not lengths:
        raise TypeError(f"{method_name}: Dispatch.DP_COMPUTE_PROTO needs at least one DataProto argument")
    if len(lengths) > 1:
        raise ValueError(f"{method_name}: DataProto arguments have different row counts {sorted(lengths)}")
    length = lengths.pop()
    pad_size = -length % world_size

    def per_rank(value: Any) -> list:
        if isinstance(value, DataProto):
            return pad_dataproto_to_divisor(value, world_size)[0].chunk(world_size)
        return [value] * world_size

    arg_shards = [per_rank(value) for value in args]
    kwarg_shards = {key: per_rank(value) for key, value in kwargs.items()}
    rank_arguments = [(tuple(shards[rank] for shards in arg_shards),
                       {key: shards[rank] for key, shards in kwarg_shards.items()}) for rank in range(world_size)]
    return PlannedCall(rank_arguments, lambda outputs: _concat_and_unpad(method_name, outputs, length, pad_size))


def _concat_and_unpad(method_name: str, outputs: list, input_length: int, pad_size: int) -> DataProto:
    wrong = {rank: type(output).__name__ for rank, output in enumerate(outputs) if not isinstance(output, DataProto)}
    if wrong:
        raise TypeError(f"{method_name}: a Dispatch.DP_COMPUTE_PROTO method must return a DataProto; "
                        f"ranks returned {wrong}")
    output = DataProto.concat(outputs)
    if pad_size == 0 or len(output) == 0:  # an output of meta_info only (e.g. metrics) carries no padding
        return output
    if len(output) != input_length + pad_size:
        raise ValueError(f"{method_name}: the input was padded from {input_length} to {input_length + pad_size} "
                         f"rows but the ranks returned {len(output)} rows, so the padding cannot be removed; "
                         f"return one row per input row or send a batch that divides by {len(outputs)}")
    return unpad_dataproto(output, pad_size)


_PLANNERS = {
    Dispatch.ONE_TO_ALL: _plan_one_to_all,
    Dispatch.ALL_TO_ALL: _plan_all_to_all,
    Dispatch.RANK_ZERO: _plan_rank_zero,
    Dispatch.DP_COMPUTE: _plan_all_to_all,
    Dispatch.DP_COMPUTE_PROTO: _plan_dp_compute_proto,
}
