"""Where rollout runs, one of two placements the trainer is handed (placement_for picks it from the config):

    Colocated      actor_rollout_ref.hybrid_engine=true (the default): every trainer rank also holds a rollout
                   engine, which takes the devices in turns with training (the hybrid engine)
    SeparatePool   hybrid_engine=false: the rollout on a pool of its own, its engines serving the agent loops
                   (rollout.mode=async), the weights sent to them over a process group

    trainer_pool  (trainer.nnodes x trainer.n_gpus_per_node)  actor (+ ref), critic, reward model, colocated
    rollout_pool  (rollout.nnodes x rollout.n_gpus_per_node)  rollout-only workers, one engine server per engine
                                                              (a tensor-parallel group's on its first rank)

A placement says which role the trainer pool's policy workers hold, which worker group's engines generate, and what
the loop's two mode switches mean. Colocated: `rollout_mode()` pushes the actor's current weights into the engines
and gives them their memory, `trainer_mode()` takes the memory back. SeparatePool: `rollout_mode()` is the weight
sync (trainer rank 0 broadcasts the actor's weights to every engine that holds an older version;
workers/weight_transfer_worker.py), `trainer_mode()` is nothing (the rollout pool's devices are the engines' alone).

Every engine knows the policy version it holds (`engines_version()`; the engine server's weight_version, reported
with every response: agent_loop/manager.py records it per token as response_weight_versions; the definition, the
same in every schedule: data/batch_layout.py).
"""
from __future__ import annotations

import time
from typing import Callable

import ray

from hybridrl.single_controller.ray import RayWorkerGroup
from hybridrl.trainer.ppo.metric_utils import mean_of_rank_metrics
from hybridrl.workers.rollout.async_server import WINDOW_METRICS


def placement_for(config) -> Placement:
    """The placement a config asks for (trainer/config_checks.py checked that it can run)."""
    if config.actor_rollout_ref.hybrid_engine:
        return Colocated()
    return SeparatePool(config.actor_rollout_ref.rollout)


def actor_version(policy_wg: RayWorkerGroup) -> int:
    """The policy version of the actor's weights (the workers' count, data/batch_layout.py)."""
    return policy_wg.current_weights_version().get()


class Colocated:
    """The rollout engines are the trainer pool's policy workers' own (one model: the engine generates from the very
    weights being trained, or holds a copy pushed at each rollout_mode)."""

    def __init__(self):
        self.policy_wg: RayWorkerGroup | None = None  # the trainer pool's policy workers, which also generate
        self._version: int | None = None  # the engines' version while in rollout mode (None: in trainer mode)

    @staticmethod
    def actor_role(with_reference: bool) -> str:
        return "actor_rollout_ref" if with_reference else "actor_rollout"

    def start(self, policy_wg: RayWorkerGroup, spawn_rollout: Callable[[], RayWorkerGroup]) -> RayWorkerGroup:
        """The worker group whose engines generate: the policy workers themselves (`spawn_rollout` is not called)."""
        self.policy_wg = policy_wg
        return policy_wg

    def connect(self) -> None:
        """Nothing: rollout_mode hands the engines the weights in-process."""

    def rollout_mode(self) -> dict[str, float]:
        """Trainer mode -> rollout mode on every rank (weights pushed unless the engine holds them); timings. The
        engines' version is read once here: it cannot change before trainer mode (an update or a checkpoint load
        needs trainer mode), so the step's generation and its batch ask no worker again."""
        asked = self.policy_wg.current_weights_version()  # with the switch: one round trip for both
        metrics = mean_of_rank_metrics(self.policy_wg.rollout_mode())
        self._version = asked.get()
        return metrics

    def trainer_mode(self) -> dict[str, float]:
        """Rollout mode -> trainer mode on every rank (the engine releases its memory); timings."""
        self._version = None
        return mean_of_rank_metrics(self.policy_wg.trainer_mode())

    def engines_version(self) -> int:
        """The version the engines generate with in rollout mode: the actor's (read by rollout_mode; in trainer
        mode, asked of the workers)."""
        return self._version if self._version is not None else actor_version(self.policy_wg)


class SeparatePool:
    """Rollout-only workers on the rollout pool, their engines fed by the trainer pool's actor over a weight-transfer
    group (gloo on CPU, NCCL on GPU)."""

    def __init__(self, rollout_config):
        """rollout_config: the `actor_rollout_ref.rollout` section (the engine's dtype, the transfer's buckets)."""
        self.rollout_config = rollout_config
        self.policy_wg: RayWorkerGroup | None = None  # the trainer pool's actor, which sends
        self.rollout_wg: RayWorkerGroup | None = None  # the rollout pool's workers, which receive and generate
        self.rollout_version: int | None = None  # the policy version every engine holds
        self.weight_metas: list = []

    @staticmethod
    def actor_role(with_reference: bool) -> str:
        return "actor_ref" if with_reference else "actor"

    def start(self, policy_wg: RayWorkerGroup, spawn_rollout: Callable[[], RayWorkerGroup]) -> RayWorkerGroup:
        """The worker group whose engines generate: the rollout pool's, spawned now."""
        self.policy_wg = policy_wg
        self.rollout_wg = spawn_rollout()
        return self.rollout_wg

    def connect(self) -> None:
        """Trainer rank 0 and every rollout rank join one process group; the engines (serving by now) then get the
        actor's initial weights (version 0)."""
        rollout = self.rollout_config
        # the engines hold rollout.dtype copies; hf generates from the exact weights
        wire_dtype = rollout.dtype if rollout.name in ("sglang", "vllm") else None
        self.weight_metas = self.policy_wg.describe_weights(wire_dtype)[0]
        address, port = self.policy_wg.weight_sender_address()[0]
        world_size = 1 + self.rollout_wg.world_size
        wait_together(self.policy_wg.init_weight_sender(address, port, world_size),
                      self.rollout_wg.init_weight_receiver(address, port, world_size, self.weight_metas,
                                                           rollout.update_weights_bucket_megabytes << 20))
        self.sync_weights()

    def rollout_mode(self) -> dict[str, float]:
        """The engines get the current weights (they never give their memory away: no switch)."""
        return self.sync_weights()

    def trainer_mode(self) -> dict[str, float]:
        """Nothing: the rollout pool's devices are the engines' alone."""
        return {}

    def engines_version(self) -> int:
        """The version the engines hold since the last sync (no call: the controller made that sync)."""
        return self.rollout_version

    def sync_weights(self) -> dict[str, float]:
        """Give every engine the actor's current weights unless it holds them already; timing_s/sync_weights and
        the parts' timings, and what the servers saw while they held the previous weights (async_server.
        window_metrics, the mean over the servers). The engines pause (finishing the requests under way) and resume
        around it."""
        version = actor_version(self.policy_wg)
        if version == self.rollout_version:
            return {}
        started = time.perf_counter()
        sent, received = wait_together(self.policy_wg.send_weights(self.weight_metas),
                                       self.rollout_wg.receive_weights(version))
        self.rollout_version = version
        return {"timing_s/sync_weights": time.perf_counter() - started,
                "timing_s/send_weights": sent[0]["timing_s/send_weights"],
                "weight_sync/megabytes": sent[0]["weight_sync/megabytes"],
                "timing_s/receive_weights": max(rank["timing_s/receive_weights"] for rank in received),
                "timing_s/pause_engine": max(rank["timing_s/pause_engine"] for rank in received),
                **mean_of_rank_metrics([{key: rank[key] for key in WINDOW_METRICS if key in rank}
                                        for rank in received])}


Placement = Colocated | SeparatePool


def wait_together(*futures) -> list:
    """The results of group calls that only finish together (both sides of a collective), in order. Whichever
    side fails first raises at once: the other would wait in the collective until its timeout."""
    pending = [ref for future in futures for ref in future.refs]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # a worker's error, or a dead worker, surfaces here
    return [future.get() for future in futures]
