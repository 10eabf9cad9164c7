"""Placement per role: named resource pools and which role runs in which (verl's ResourcePoolManager).

    pool name -> processes per node x nodes        role -> pool name

Colocated (`actor_rollout_ref.hybrid_engine=true`, the default): one pool, `trainer_pool`, holds every role, one
process per GPU taking turns (actor/rollout/ref in one worker, critic and reward model beside them).
Disaggregated (`hybrid_engine=false`): `trainer_pool` (trainer.nnodes x trainer.n_gpus_per_node) holds the actor
(+ ref), critic and reward model; `rollout_pool` (rollout.nnodes x rollout.n_gpus_per_node) holds rollout-only
workers, one engine server each. On CPU (trainer.device=cpu) a "GPU" is a process with one CPU, as everywhere.

`check_fits` compares what the pools need with what the Ray cluster has, before any worker starts, and names
what is short (per resource, and per node: a pool's node must fit on one Ray node).

Importing this module does not import Ray (the driver's preflight reads `pool_specs` before Ray is set up).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the driver imports ray only once it is in single-machine mode
    from hybridrl.single_controller.ray import RayResourcePool

TRAINER_POOL = "trainer_pool"
ROLLOUT_POOL = "rollout_pool"

# Roles (keys of RayPPOTrainer's worker groups) and the pool each runs in, per placement.
COLOCATED_MAPPING = {"actor_rollout": TRAINER_POOL, "critic": TRAINER_POOL, "rm": TRAINER_POOL}
DISAGGREGATED_MAPPING = {"actor": TRAINER_POOL, "critic": TRAINER_POOL, "rm": TRAINER_POOL, "rollout": ROLLOUT_POOL}


@dataclass
class PoolSpec:
    processes_per_node: int
    nnodes: int
    where: str  # the config keys that size it, for error messages

    @property
    def process_on_nodes(self) -> list[int]:
        return [self.processes_per_node] * self.nnodes

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.nnodes


def pool_specs(config) -> dict[str, PoolSpec]:
    """The pools a run's config asks for (see the module docstring)."""
    trainer = config.trainer
    specs = {TRAINER_POOL: PoolSpec(trainer.n_gpus_per_node, trainer.nnodes,
                                    "trainer.nnodes * trainer.n_gpus_per_node")}
    if not config.actor_rollout_ref.hybrid_engine:
        specs[ROLLOUT_POOL] = PoolSpec(config.rollout.n_gpus_per_node, config.rollout.nnodes,
                                       "rollout.nnodes * rollout.n_gpus_per_node")
    return specs


def role_mapping(config) -> dict[str, str]:
    return dict(COLOCATED_MAPPING if config.actor_rollout_ref.hybrid_engine else DISAGGREGATED_MAPPING)


def shortfalls(specs: dict[str, PoolSpec], use_gpu: bool, cluster_total: dict[str, float],
               node_capacities: list[dict[str, float]]) -> list[str]:
    """What the pools need that the cluster lacks, one line per shortage; [] when they fit.

    cluster_total: ray.cluster_resources(); node_capacities: each alive node's resources. A pool's node is one
    STRICT_PACK placement group, so the largest per-node ask must also fit on some Ray node."""
    resources = ("CPU", "GPU") if use_gpu else ("CPU",)
    unit = "GPU" if use_gpu else "process (1 CPU)"
    problems = []
    for resource in resources:
        needed = sum(spec.world_size for spec in specs.values())
        have = cluster_total.get(resource, 0)
        if needed > have:
            asked = " + ".join(f"{name} {spec.world_size} ({spec.where})" for name, spec in specs.items())
            problems.append(f"the pools need {needed} {resource} in all ({asked}), the Ray cluster has {have:g}: "
                            f"{needed - have:g} {resource} short")
    for name, spec in specs.items():
        for resource in resources:
            largest = max((node.get(resource, 0) for node in node_capacities), default=0)
            if spec.processes_per_node > largest:
                problems.append(f"{name} needs {spec.processes_per_node} {unit} on one node ({spec.where}), the "
                                f"largest Ray node has {largest:g} {resource}")
    return problems


class ResourcePoolManager:
    """Builds one RayResourcePool per pool spec and answers which pool a role runs in."""

    def __init__(self, specs: dict[str, PoolSpec], mapping: dict[str, str], use_gpu: bool):
        unknown = sorted(set(mapping.values()) - set(specs))
        if unknown:
            raise ValueError(f"ResourcePoolManager: roles map to pool(s) {unknown} that are not defined; "
                             f"defined: {sorted(specs)}")
        self.specs, self.mapping, self.use_gpu = specs, mapping, use_gpu
        self.pools: dict[str, RayResourcePool] = {}

    def check_fits(self) -> None:
        """Raise naming every shortage before any placement group or worker is created."""
        import ray

        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        problems = shortfalls(self.specs, self.use_gpu, ray.cluster_resources(), nodes)
        if problems:
            raise RuntimeError("the resource pools do not fit the Ray cluster:\n  " + "\n  ".join(problems))

    def create_pools(self) -> None:
        from hybridrl.single_controller.ray import RayResourcePool

        self.check_fits()
        for name, spec in self.specs.items():
            self.pools[name] = RayResourcePool(process_on_nodes=spec.process_on_nodes, use_gpu=self.use_gpu,
                                               name_prefix=f"hybridrl_{name}_")

    def pool_of(self, role: str) -> RayResourcePool:
        return self.pools[self.mapping[role]]

    def remove(self) -> None:
        for pool in self.pools.values():
            pool.remove()
