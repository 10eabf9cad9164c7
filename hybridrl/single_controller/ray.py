"""Worker groups on Ray: where the ranks run (RayResourcePool), what they run (RayClassWithInitArgs),
and the controller-side handle that calls them (RayWorkerGroup).

One Ray actor is one rank. Several roles (actor/rollout/ref, critic, reward model) can share
each rank's process: create_colocated_worker_cls builds one actor class that holds an instance
of every role, and RayWorkerGroup.spawn hands back one group view per role.

A group made with a WorkerWatch waits for its ranks to start within ``start_timeout`` and watches every call
(heartbeats, timeouts: heartbeat.py); without one, calls wait as long as they take.
"""
from __future__ import annotations

import inspect
import uuid
from typing import Any, Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridrl.protocol import DataProto
from hybridrl.single_controller.decorator import REGISTER_ATTRIBUTE, Registration, plan_call, registered_methods
from hybridrl.single_controller.heartbeat import (INTERVAL_ENV, MONITOR_ENV, HeartbeatMonitor, WorkerWatch,
                                                  wait_for_ranks)
from hybridrl.single_controller.rendezvous import KEY_ENV, forget_rendezvous
from hybridrl.single_controller.worker import Worker

PLACEMENT_GROUP_TIMEOUT_S = 120


class RayResourcePool:
    """The bundles a worker group runs in: one STRICT_PACK placement group per node, holding
    ``process_on_nodes[i]`` bundles of {"CPU": 1} (plus {"GPU": 1} with use_gpu). Up to
    max_colocate_count worker groups may share the bundles, each taking that fraction of them.
    Placement groups are created on first use (Ray must be running by then); ``remove()`` frees them."""

    def __init__(self, process_on_nodes: list[int], use_gpu: bool, name_prefix: str = "",
                 max_colocate_count: int = 1):
        if not process_on_nodes or any(not isinstance(count, int) or count <= 0 for count in process_on_nodes):
            raise ValueError(f"RayResourcePool: process_on_nodes must be a non-empty list of positive ints, "
                             f"got {process_on_nodes!r}")
        if not isinstance(max_colocate_count, int) or max_colocate_count <= 0:
            raise ValueError(f"RayResourcePool: max_colocate_count must be a positive int, got {max_colocate_count!r}")
        self.process_on_nodes = list(process_on_nodes)
        self.use_gpu = use_gpu
        self.name_prefix = name_prefix
        self.max_colocate_count = max_colocate_count
        self.pool_name = f"{name_prefix}pool_{uuid.uuid4().hex[:8]}"  # its placement groups' and rendezvous' prefix
        self._placement_groups: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def bundle(self) -> dict[str, float]:
        return {"CPU": 1, "GPU": 1} if self.use_gpu else {"CPU": 1}

    def placement_groups(self) -> list[PlacementGroup]:
        if self._placement_groups is None:
            self._check_cluster_total()
            groups = [placement_group([self.bundle] * count, strategy="STRICT_PACK",
                                      name=f"{self.pool_name}_node{index}")
                      for index, count in enumerate(self.process_on_nodes)]
            try:
                ray.get([group.ready() for group in groups], timeout=PLACEMENT_GROUP_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                for group in groups:
                    remove_placement_group(group)
                raise RuntimeError(f"RayResourcePool: placement groups of {self.process_on_nodes} x {self.bundle} "
                                   f"(one node each) were not ready after {PLACEMENT_GROUP_TIMEOUT_S} s; "
                                   f"available now: {ray.available_resources()}") from None
            self._placement_groups = groups
        return self._placement_groups

    def remove(self) -> None:
        """Free the placement groups (Ray kills the actors that run in them) and forget their groups' rendezvous."""
        if self._placement_groups is None:
            return
        for group in self._placement_groups:
            remove_placement_group(group)
        forget_rendezvous(f"{self.pool_name}/")
        self._placement_groups = None

    def _check_cluster_total(self) -> None:
        total = ray.cluster_resources()
        for resource, amount in self.bundle.items():
            if total.get(resource, 0) < amount * self.world_size:
                raise RuntimeError(f"RayResourcePool: {self.world_size} processes need {amount * self.world_size} "
                                   f"{resource} in total, the Ray cluster has {total.get(resource, 0)}")


class RayClassWithInitArgs:
    """A plain worker class and the arguments to construct it with on every rank."""

    def __init__(self, cls: type, *args, **kwargs):
        if not isinstance(cls, type):
            raise TypeError(f"RayClassWithInitArgs: cls must be a plain Python class, got {cls!r} "
                            f"(do not apply ray.remote: the worker group does, with the placement options)")
        self.cls = cls
        self.args = args
        self.kwargs = kwargs


class WorkerGroupFuture:
    """What a blocking=False method returns: ``refs`` (one per rank that runs, for ray.wait) and
    ``get()``, which waits (watched as the group's calls are) and gathers them as the blocking call would have."""

    def __init__(self, refs: list[ray.ObjectRef], collect: Callable[[list], Any],
                 wait: Callable[[list[ray.ObjectRef]], list]):
        self.refs = refs
        self._collect = collect
        self._wait = wait

    def get(self) -> Any:
        return self._collect(self._wait(self.refs))


class RayWorkerGroup:
    """One Ray actor per bundle of the pool (rank order: node by node, bundle by bundle), and every
    @register-ed method of the worker class bound as a method of this group."""

    def __init__(self, resource_pool: RayResourcePool, ray_cls_with_init: RayClassWithInitArgs,
                 name_prefix: str | None = None, watch: WorkerWatch | None = None):
        _check_method_names(ray_cls_with_init.cls)
        name_prefix = name_prefix or f"{ray_cls_with_init.cls.__name__}_{uuid.uuid4().hex[:8]}"
        workers, monitor = _create_workers(resource_pool, ray_cls_with_init, name_prefix, watch)
        self._attach(_RankWatch(workers, monitor, watch, name_prefix), ray_cls_with_init.cls, "")
        if watch is not None:
            self._rank_watch.wait_started(f"starting {ray_cls_with_init.cls.__name__}")

    @classmethod
    def _view(cls, rank_watch: _RankWatch, worker_cls: type, method_prefix: str) -> RayWorkerGroup:
        # A view shares the actors of another group; it needs no resources of its own, so skip __init__.
        view = cls.__new__(cls)
        view._attach(rank_watch, worker_cls, method_prefix)
        return view

    def _attach(self, rank_watch: _RankWatch, worker_cls: type, method_prefix: str) -> None:
        self._rank_watch = rank_watch
        self._workers = rank_watch.workers
        self._worker_cls = worker_cls
        self._method_prefix = method_prefix
        for name, registration in registered_methods(worker_cls).items():
            setattr(self, name, self._bound_method(name, registration))

    def _bound_method(self, name: str, registration: Registration) -> Callable:
        def call(*args, **kwargs):
            planned = plan_call(registration, self.world_size, name, args, kwargs)
            method_name = self._method_prefix + name
            refs = self._submit(method_name, planned.rank_arguments)
            future = WorkerGroupFuture(refs, planned.collect,
                                       lambda refs: self._rank_watch.wait(refs, list(range(len(refs))), method_name))
            return future.get() if registration.blocking else future

        call.__name__ = name
        call.__doc__ = getattr(self._worker_cls, name).__doc__
        return call

    def _submit(self, method_name: str, rank_arguments: list[tuple[tuple, dict]]) -> list[ray.ObjectRef]:
        # Ray serializes an argument once per call; putting a DataProto that several ranks get (ONE_TO_ALL) in the
        # object store once means it is serialized once and read there by all of them. A rank's own DataProto (its
        # DP_COMPUTE_PROTO chunk) is passed as it is: Ray sends one under 100 KiB inside the call, without the object
        # store's round trip (each put cost 1.5-3.5 ms on 2 loaded cores), and puts a larger one there itself.
        shared = _shared_dataprotos(rank_arguments)
        stored: dict[int, ray.ObjectRef] = {}

        def store(value: Any) -> Any:
            if id(value) not in shared:
                return value
            if id(value) not in stored:
                stored[id(value)] = ray.put(value)
            return stored[id(value)]

        return [getattr(self._workers[rank], method_name).remote(*[store(value) for value in args],
                                                                 **{key: store(value) for key, value in kwargs.items()})
                for rank, (args, kwargs) in enumerate(rank_arguments)]

    @property
    def world_size(self) -> int:
        return len(self._workers)

    @property
    def workers(self) -> list:
        return list(self._workers)

    def execute_all_sync(self, method_name: str, *args, **kwargs) -> list:
        """Call any method (registered or not) on every rank with the same arguments; the list of results."""
        refs = self._submit(self._method_prefix + method_name, [(args, kwargs)] * self.world_size)
        return self._rank_watch.wait(refs, list(range(self.world_size)), self._method_prefix + method_name)

    def spawn(self, prefix_set: list[str] | set[str]) -> dict[str, RayWorkerGroup]:
        """For a group of create_colocated_worker_cls(...): one view per role, whose methods are the
        role's methods, called on the shared actors."""
        role_classes = getattr(self._worker_cls, "role_classes", None)
        if role_classes is None:
            raise TypeError(f"spawn: {self._worker_cls.__name__} is not a colocated class; "
                            f"build it with create_colocated_worker_cls")
        unknown = sorted(set(prefix_set) - set(role_classes))
        if unknown:
            raise KeyError(f"spawn: no role(s) {unknown}; the colocated class has {sorted(role_classes)}")
        for role in prefix_set:
            _check_method_names(role_classes[role])
        return {role: RayWorkerGroup._view(self._rank_watch, role_classes[role], f"{role}_") for role in prefix_set}


class _RankWatch:
    """The actors of a group (shared by its views) and how to wait for their calls (heartbeat.py)."""

    def __init__(self, workers: list, monitor, watch: WorkerWatch | None, name_prefix: str):
        self.workers = workers
        self.monitor = monitor
        self.watch = watch
        self.actor_names = {rank: f"{name_prefix}_{rank}" for rank in range(len(workers))}

    def wait(self, refs: list[ray.ObjectRef], ranks: list[int], what: str) -> list:
        """The results of refs (rank ranks[i] computes refs[i])."""
        return wait_for_ranks(refs, ranks, what, self.monitor, self.watch, self.actor_names)

    def wait_started(self, what: str) -> None:
        """Until every rank's actor is constructed (its __init__ ran; an error in it is raised here). A rank not
        yet scheduled cannot beat, so only trainer.ray_wait_register_center_timeout applies."""
        ready = [worker.__ray_ready__.remote() for worker in self.workers]
        wait_for_ranks(ready, list(range(len(ready))), what, None, self.watch, self.actor_names,
                       limit=self.watch.start_timeout, limit_key="trainer.ray_wait_register_center_timeout")


def _shared_dataprotos(rank_arguments: list[tuple[tuple, dict]]) -> set[int]:
    """The ids of the DataProto arguments that more than one rank gets."""
    ranks_of: dict[int, int] = {}
    for args, kwargs in rank_arguments:
        for value in {id(value): value for value in (*args, *kwargs.values())}.values():
            if isinstance(value, DataProto):
                ranks_of[id(value)] = ranks_of.get(id(value), 0) + 1
    return {key for key, ranks in ranks_of.items() if ranks > 1}


def _check_method_names(worker_cls: type) -> None:
    for name in registered_methods(worker_cls):
        if name.startswith("_") or hasattr(RayWorkerGroup, name):
            raise AttributeError(f"{worker_cls.__name__}.{name}: a registered method cannot be named like the "
                                 f"RayWorkerGroup attribute {name!r} or start with '_'")


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """One worker class whose instance holds one instance of every role, built in the same process with
    that role's own init arguments. Each public method m of role r is exposed as ``r_m`` (with its
    @register metadata), so a group of this class can call every role and spawn() gives per-role views."""
    role_inits = dict(class_dict)

    class ColocatedWorker(Worker):
        role_classes = {role: init.cls for role, init in role_inits.items()}

        def __init__(self):
            super().__init__()
            self._roles = {role: init.cls(*init.args, **init.kwargs) for role, init in role_inits.items()}

    for role, init in role_inits.items():
        for name, function in inspect.getmembers(init.cls, inspect.isfunction):
            if name.startswith("_"):
                continue
            if hasattr(ColocatedWorker, f"{role}_{name}"):
                raise ValueError(f"create_colocated_worker_cls: method name {role}_{name} is taken twice")
            setattr(ColocatedWorker, f"{role}_{name}",
                    _forward_to_role(role, name, getattr(function, REGISTER_ATTRIBUTE, None)))
    ColocatedWorker.__name__ = ColocatedWorker.__qualname__ = "Colocated_" + "_".join(role_inits)
    return RayClassWithInitArgs(ColocatedWorker)


def _forward_to_role(role: str, name: str, registration: Registration | None) -> Callable:
    def forward(self, *args, **kwargs):
        return getattr(self._roles[role], name)(*args, **kwargs)

    forward.__name__ = f"{role}_{name}"
    if registration is not None:
        setattr(forward, REGISTER_ATTRIBUTE, registration)
    return forward


def _create_workers(pool: RayResourcePool, ray_cls_with_init: RayClassWithInitArgs, name_prefix: str,
                    watch: WorkerWatch | None) -> tuple[list, Any]:
    """The group's actors, one per bundle, and its heartbeat monitor (None without a watch). The monitor runs in
    rank 0's bundle (it takes no CPU), so that freeing the pool ends it with the ranks: elsewhere it outlived them for
    as long as the driver held the group object."""
    groups = pool.placement_groups()
    rendezvous_key = f"{pool.pool_name}/{name_prefix}/{uuid.uuid4().hex[:8]}"  # rank 0 publishes its address there
    monitor, heartbeat_env = None, {}
    if watch is not None:
        monitor = HeartbeatMonitor.options(
            name=f"{name_prefix}_heartbeat",
            scheduling_strategy=PlacementGroupSchedulingStrategy(groups[0], placement_group_bundle_index=0)).remote()
        heartbeat_env = {MONITOR_ENV: f"{name_prefix}_heartbeat", INTERVAL_ENV: str(watch.heartbeat_interval)}
    remote_cls = ray.remote(ray_cls_with_init.cls)
    share = 1 / pool.max_colocate_count
    workers = []
    for group, count in zip(groups, pool.process_on_nodes):
        for local_rank in range(count):
            rank = len(workers)
            env_vars = {"RANK": str(rank), "WORLD_SIZE": str(pool.world_size), "LOCAL_RANK": str(local_rank),
                        KEY_ENV: rendezvous_key, **heartbeat_env}
            options = {"num_cpus": share, "name": f"{name_prefix}_{rank}", "runtime_env": {"env_vars": env_vars},
                       "scheduling_strategy": PlacementGroupSchedulingStrategy(
                           group, placement_group_bundle_index=local_rank)}
            if pool.use_gpu:
                options["num_gpus"] = share
            workers.append(remote_cls.options(**options).remote(*ray_cls_with_init.args, **ray_cls_with_init.kwargs))
    return workers, monitor
