"""Config checks of the Ray cluster and the ranks' liveness (local_cluster.py, heartbeat.py), registered with
hybridrl.config.checks: a joined cluster refuses the local-cluster keys, heartbeats fit in their timeout, and a local
Ray has a CPU (and on CUDA a GPU) for every rank."""
from __future__ import annotations

import os

from hybridrl.config.checks import Values, register_check
from hybridrl.config.schema import PPOConfig


@register_check()
def _local_ray_keys_only_for_a_local_ray(values: Values, problems: list[str]) -> None:
    """The keys of the Ray cluster the driver starts itself (single_controller/local_cluster.py) mean nothing to a
    running cluster (`ray_init.address`): refused there, not silently ignored."""
    address = values("ray_init.address")
    if address is None:
        return
    num_cpus = values("ray_init.num_cpus")
    if num_cpus is not None:
        problems.append(f"ray_init.num_cpus: expected null when ray_init.address is set (a running cluster "
                        f"declares its own CPUs), got {num_cpus}")
    node_ip_address = values("ray_init.node_ip_address")
    if node_ip_address is not None:
        problems.append(f"ray_init.node_ip_address: expected null when ray_init.address is set (the nodes of a "
                        f"running cluster have their own addresses), got {node_ip_address!r}")
    if values("ray_init.include_dashboard"):
        problems.append("ray_init.include_dashboard: expected false when ray_init.address is set (a running "
                        "cluster has its own dashboard or none), got True")
    start_timeout_s = values("ray_init.start_timeout_s")
    if start_timeout_s is not None:
        problems.append(f"ray_init.start_timeout_s: expected null when ray_init.address is set (it bounds the start "
                        f"of a local Ray; a running cluster is joined at once), got {start_timeout_s:g}")


@register_check()
def _heartbeats_fit_in_their_timeout(values: Values, problems: list[str]) -> None:
    interval, timeout = values("trainer.heartbeat_interval"), values("trainer.heartbeat_timeout")
    if timeout < 2 * interval:
        problems.append(f"trainer.heartbeat_timeout: expected at least 2 * trainer.heartbeat_interval = "
                        f"{2 * interval:g} (a rank is silent only after missing heartbeats), got {timeout:g}")


@register_check("preflight")
def _check_resources(config: PPOConfig, problems: list[str]) -> None:
    """A local Ray gets ray_init.num_cpus (default: the CPUs Ray detects) and the visible GPUs; each rank takes one
    CPU, and one GPU on CUDA. A running cluster (ray_init.address) is checked once joined (RayResourcePool)."""
    if config.ray_init.address is not None:
        return
    from hybridrl.single_controller.resource_pool_manager import pool_specs

    trainer = config.trainer
    specs = pool_specs(config)  # the rollout's own pool too with actor_rollout_ref.hybrid_engine=false
    ranks = sum(spec.world_size for spec in specs.values())
    got = " + ".join(f"{spec.where} = {spec.nnodes} * {spec.processes_per_node}" for spec in specs.values()) \
        + f" = {ranks}"
    cpus = config.ray_init.num_cpus or _cpus_ray_detects()
    cpus_from = "ray_init.num_cpus" if config.ray_init.num_cpus else "ray_init.num_cpus=null: the CPUs Ray detects"
    if ranks > cpus:
        problems.append(f"trainer.n_gpus_per_node: expected at most {cpus} ranks in all (one CPU each; the local "
                        f"Ray has {cpus} CPUs, {cpus_from}), got {got}")
    gpus = _visible_gpus()
    if (trainer.device == "cuda" or (trainer.device == "auto" and gpus > 0)) and ranks > gpus:
        problems.append(f"trainer.n_gpus_per_node: expected at most {gpus} ranks in all (one GPU each with "
                        f"trainer.device={trainer.device!r}; {gpus} GPUs are visible), got {got}")


def _cpus_ray_detects() -> int:
    """The CPUs a local Ray will count: those this process may run on, capped by a cgroup-v2 CPU quota.

    Read here without importing `ray`: the driver must import it only once run_ppo has put it in its
    single-machine mode (single_controller/local_cluster.py)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()
