"""Single controller on a real local Ray: dispatch modes, padding, async calls, colocated roles, gloo."""
import errno
import os
import socket
import sys
from unittest import mock

import pytest
import ray
import torch
import torch.distributed as dist
from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_list

from hybridrl.protocol import DataProto
from hybridrl.single_controller import Dispatch, Execute, Worker, register
from hybridrl.single_controller.ray import (RayClassWithInitArgs, RayResourcePool, RayWorkerGroup,
                                            WorkerGroupFuture, create_colocated_worker_cls)
from hybridrl.single_controller.rendezvous import KEY_ENV, NAMESPACE, forget_rendezvous
from hybridrl.utils import distributed
from hybridrl.utils.distributed import init_process_group_once

# Ray workers cannot import this test module by name; ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ShardWorker(Worker):
    def __init__(self, scale: int):
        super().__init__()
        self.scale = scale
        self.rank_zero_calls = 0

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def sum_rows(self, data: DataProto, offset: int = 0) -> DataProto:
        row_sums = data.batch["x"].sum(dim=1) * self.scale + offset
        return DataProto({"row_sum": row_sums}, meta_info={"rank": self.rank, "metrics": {"rows": len(data)}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def sum_rows_async(self, data: DataProto) -> DataProto:
        return self.sum_rows(data)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update(self, data: DataProto) -> DataProto:
        return DataProto(meta_info={"metrics": {"seen_rows": len(data)}})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def first_row_only(self, data: DataProto) -> DataProto:
        return data[:1]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank, "pid": os.getpid(),
                "threads": torch.get_num_threads()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def total_of_x(self, data: DataProto) -> int:
        return data.batch["x"].sum().item() + self.rank

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def multiply(self, value: int, factor: int = 1) -> int:
        return value * factor * (self.rank + 1)

    @register(dispatch_mode=Dispatch.DP_COMPUTE)
    def add_rank(self, value: int) -> int:
        return value + self.rank

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def count_on_rank_zero(self) -> int:
        self.rank_zero_calls += 1
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def executed_on_rank_zero(self, value: int) -> tuple[int, int]:
        self.rank_zero_calls += 1
        return self.rank, value

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_rank_plus_one(self) -> tuple[str, float]:
        init_process_group_once()
        init_process_group_once()  # a second role in the same process: a no-op
        value = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(value)
        return dist.get_backend(), value.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def rendezvous_environment(self) -> tuple[str, int]:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

    def count_calls(self) -> int:  # not registered: reachable through execute_all_sync
        return self.rank_zero_calls


class Role(Worker):
    """A role of the colocated class: its own counter, its own init argument."""

    def __init__(self, start: int):
        super().__init__()
        self.total = start

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def add(self, amount: int) -> tuple[int, int]:
        self.total += amount
        return os.getpid(), self.total

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def shift(self, data: DataProto) -> DataProto:
        return DataProto({"y": data.batch["x"][:, 0] + self.total})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_total(self) -> float:
        init_process_group_once()
        value = torch.tensor([float(self.total)])
        dist.all_reduce(value)
        return value.item()


@pytest.fixture(scope="module")
def shared_pool(ray_local):
    """Two CPU bundles shared by the module's two worker groups (max_colocate_count=2, half a CPU each)."""
    pool = RayResourcePool([2], use_gpu=False, max_colocate_count=2)
    yield pool
    pool.remove()


@pytest.fixture(scope="module")
def shard_group(shared_pool):
    return RayWorkerGroup(shared_pool, RayClassWithInitArgs(ShardWorker, scale=10))


@pytest.fixture(scope="module")
def colocated_group(shared_pool):
    colocated = create_colocated_worker_cls({"actor": RayClassWithInitArgs(Role, start=0),
                                             "critic": RayClassWithInitArgs(Role, start=100)})
    return RayWorkerGroup(shared_pool, colocated)


def make_rows(count: int) -> DataProto:
    """Row i is [3i, 3i+1, 3i+2], so its sum is 9i + 3."""
    return DataProto({"x": torch.arange(3 * count).reshape(count, 3)}, meta_info={"step": 4})


# --------------------------------------------------------------------------------------------------
# dispatch modes on a 2-rank group


def test_dp_compute_proto_splits_and_gathers_an_even_batch(shard_group):
    output = shard_group.sum_rows(make_rows(4))
    assert output.batch["row_sum"].tolist() == [30, 120, 210, 300]
    assert output.meta_info == {"rank": 0, "metrics": {"rows": [2, 2]}}


def test_dp_compute_proto_pads_and_unpads_an_odd_batch(shard_group):
    output = shard_group.sum_rows(make_rows(5), offset=7)
    assert output.batch["row_sum"].tolist() == [37, 127, 217, 307, 397]  # 5 rows back, none of the padding
    assert output.meta_info["metrics"] == {"rows": [3, 3]}  # 5 rows + 1 padding row, split 3 + 3
    assert shard_group.sum_rows(make_rows(1)).batch["row_sum"].tolist() == [30]


def test_dp_compute_proto_outputs_without_rows_and_mismatched_rows(shard_group):
    assert shard_group.update(make_rows(3)).meta_info == {"metrics": {"seen_rows": [2, 2]}}
    assert shard_group.first_row_only(make_rows(4)).batch["x"][:, 0].tolist() == [0, 6]
    with pytest.raises(ValueError, match=r"padded from 3 to 4 rows but the ranks returned 2 rows"):
        shard_group.first_row_only(make_rows(3))
    with pytest.raises(TypeError, match="DP_COMPUTE_PROTO needs at least one DataProto argument"):
        shard_group.sum_rows(offset=1)


def test_non_blocking_call_returns_a_future(shard_group):
    future = shard_group.sum_rows_async(make_rows(3))
    assert isinstance(future, WorkerGroupFuture) and len(future.refs) == 2
    ready, _ = ray.wait(future.refs, num_returns=2, timeout=300)  # a hang guard
    assert len(ready) == 2
    assert future.get().batch["row_sum"].tolist() == [30, 120, 210]


def test_one_to_all_reaches_every_rank_with_its_environment(shard_group):
    described = shard_group.describe()
    assert [(d["rank"], d["world_size"], d["local_rank"]) for d in described] == [(0, 2, 0), (1, 2, 1)]
    assert described[0]["pid"] != described[1]["pid"]
    assert [d["threads"] for d in described] == [1, 1]  # Ray's OMP_NUM_THREADS for a fraction of a CPU
    assert shard_group.total_of_x(make_rows(4)) == [66, 67]  # the whole batch on each rank


def test_only_a_batch_every_rank_gets_goes_through_the_object_store(shard_group):
    """ONE_TO_ALL: the batch is put once and read by both ranks. DP_COMPUTE_PROTO: each rank's chunk is its own, so
    it goes with the call (issue 58: a put per chunk cost 1.5-3.5 ms on 2 loaded cores; Ray sends one under
    100 KiB inside the call and puts a larger one itself)."""
    with mock.patch.object(ray, "put", wraps=ray.put) as put:
        assert shard_group.total_of_x(make_rows(4)) == [66, 67]
        assert put.call_count == 1
        assert shard_group.sum_rows(make_rows(4)).batch["row_sum"].tolist() == [30, 120, 210, 300]
        large = DataProto({"x": torch.ones(2 * 12_000, 3, dtype=torch.int64)})  # 288 KB a rank: over 100 KiB
        assert shard_group.sum_rows(large).batch["row_sum"].tolist() == [30] * 24_000
        assert put.call_count == 1


def test_all_to_all_and_dp_compute_give_each_rank_its_entry(shard_group):
    assert shard_group.multiply([3, 4], factor=[10, 100]) == [30, 800]
    assert shard_group.add_rank([5, 6]) == [5, 7]
    with pytest.raises(ValueError, match=r"multiply: argument 0 must be a list with one entry per rank \(2\), "
                                         r"got length 3"):
        shard_group.multiply([1, 2, 3])


def test_rank_zero_modes_run_only_rank_zero(shard_group):
    before = shard_group.execute_all_sync("count_calls")
    assert shard_group.count_on_rank_zero() == 0
    assert shard_group.executed_on_rank_zero(9) == (0, 9)
    after = shard_group.execute_all_sync("count_calls")
    assert [a - b for a, b in zip(after, before)] == [2, 0]


def test_gloo_all_reduce_over_two_ranks(shard_group):
    assert shard_group.all_reduce_rank_plus_one() == [("gloo", 3.0), ("gloo", 3.0)]


def test_rank_zero_holds_the_rendezvous_port_it_publishes(shard_group, shared_pool):
    """Rank 0 listens on its port before it tells the other ranks, so nothing can take the port in between (a port
    found free and bound later was taken by another connection once, and the group never met)."""
    (address, port), other = shard_group.rendezvous_environment()
    assert other == (address, port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as intruder, pytest.raises(OSError) as taken:
        intruder.bind((address, port))
    assert taken.value.errno == errno.EADDRINUSE
    published = _internal_kv_list(f"{shared_pool.pool_name}/", namespace=NAMESPACE)
    assert [_internal_kv_get(key, namespace=NAMESPACE) for key in published].count(f"{address} {port}".encode()) == 1


def test_a_process_resolves_its_rendezvous_once(ray_local):
    """The roles of a colocated worker are Workers too: a second Worker in the process must not reserve and publish
    another port (rank 1 would then meet rank 0 on a port nobody serves)."""
    key = f"test_once/{os.getpid()}"
    with mock.patch.dict(os.environ):  # resolving writes MASTER_ADDR/MASTER_PORT: none may reach later tests
        os.environ.update({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", KEY_ENV: key})
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)
        Worker()
        published = _internal_kv_get(key, namespace=NAMESPACE)
        Worker()
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        assert _internal_kv_get(key, namespace=NAMESPACE) == published == f"{address} {port}".encode()
        assert port in distributed._reserved_listeners and len(distributed._reserved_listeners) == 1
    finally:
        distributed.release_port(port)
        forget_rendezvous(key)


def test_removing_a_pool_forgets_its_groups_rendezvous(ray_local):
    pool = RayResourcePool([1], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ShardWorker, scale=1))
    assert group.add_rank([5]) == [5]  # rank 0 has published by the time it answers
    assert len(_internal_kv_list(f"{pool.pool_name}/", namespace=NAMESPACE)) == 1
    pool.remove()
    assert _internal_kv_list(f"{pool.pool_name}/", namespace=NAMESPACE) == []


# --------------------------------------------------------------------------------------------------
# colocated roles


def test_colocated_roles_share_a_process_and_keep_their_state(colocated_group, shard_group):
    roles = colocated_group.spawn(prefix_set={"actor", "critic"})
    assert set(roles) == {"actor", "critic"} and roles["actor"].world_size == 2
    actor_results = roles["actor"].add(1)
    critic_results = roles["critic"].add(10)
    assert [total for _, total in actor_results] == [1, 1]
    assert [total for _, total in critic_results] == [110, 110]
    assert [pid for pid, _ in actor_results] == [pid for pid, _ in critic_results]  # one process per rank
    assert actor_results[0][0] != actor_results[1][0]
    assert {pid for pid, _ in actor_results}.isdisjoint(d["pid"] for d in shard_group.describe())
    assert [total for _, total in colocated_group.actor_add(1)] == [2, 2]  # prefixed names on the whole group
    assert roles["critic"].shift(make_rows(3)).batch["y"].tolist() == [110, 113, 116]
    assert roles["critic"].all_reduce_total() == [220.0, 220.0]  # the ranks of a colocated class meet once


def test_spawn_needs_a_colocated_class_and_known_roles(shard_group, colocated_group):
    with pytest.raises(TypeError, match="ShardWorker is not a colocated class"):
        shard_group.spawn(prefix_set={"actor"})
    with pytest.raises(KeyError, match=r"no role\(s\) \['ref'\]; the colocated class has \['actor', 'critic'\]"):
        colocated_group.spawn(prefix_set={"ref"})


# --------------------------------------------------------------------------------------------------
# errors raised before anything is started


def test_register_rejects_a_rank_zero_execution_of_split_arguments():
    with pytest.raises(ValueError, match="Execute.RANK_ZERO runs one rank"):
        register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.RANK_ZERO)
    with pytest.raises(TypeError, match="dispatch_mode must be a Dispatch"):
        register(dispatch_mode="one_to_all")


def test_worker_reads_its_place_from_the_environment(monkeypatch):
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    worker = Worker()
    assert (worker.rank, worker.world_size, worker.local_rank) == (3, 4, 1)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(RuntimeError, match=r"environment variable\(s\) \['MASTER_PORT'\] are not set"):
        Worker()
    with pytest.raises(RuntimeError, match=r"init_process_group_once: environment variable\(s\) \['MASTER_PORT'\]"):
        init_process_group_once()


def test_pool_and_class_arguments_are_checked(ray_local):
    with pytest.raises(ValueError, match=r"process_on_nodes must be a non-empty list of positive ints, got \[2, 0\]"):
        RayResourcePool([2, 0], use_gpu=False)
    assert RayResourcePool([2, 3], use_gpu=True).world_size == 5
    with pytest.raises(RuntimeError, match=r"2 processes need 2 GPU in total, the Ray cluster has 0"):
        RayResourcePool([2], use_gpu=True).placement_groups()
    with pytest.raises(TypeError, match="cls must be a plain Python class"):
        RayClassWithInitArgs(ray.remote(ShardWorker))

    class Clashing(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def spawn(self):
            return None

    with pytest.raises(AttributeError, match="Clashing.spawn: a registered method cannot be named like"):
        RayWorkerGroup(RayResourcePool([1], use_gpu=False), RayClassWithInitArgs(Clashing))
