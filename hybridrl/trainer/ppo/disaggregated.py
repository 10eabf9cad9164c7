"""DisaggregatedPPOTrainer: actor_rollout_ref.hybrid_engine=false — training and rollout on their own pools.

    trainer_pool  (trainer.nnodes x trainer.n_gpus_per_node)  actor (+ ref), critic, reward model, colocated
    rollout_pool  (rollout.nnodes x rollout.n_gpus_per_node)  rollout-only workers, one engine server per engine
                                                              (a tensor-parallel group's on its first rank),
                                                              called by the agent loops (rollout.mode=async)

The loop is RayPPOTrainer's. Its two mode switches change meaning: "rollout mode" is `sync_weights()` (the trainer
ranks broadcast the actor's weights to every engine when the engines hold an older version; workers/
weight_transfer_worker.py), "trainer mode" is nothing (the engines keep their memory: nobody else uses their
devices). The overlapping schedules (one-step-off, fully asynchronous) build on this class: async_trainer.py.

Every engine knows the policy version it holds (`rollout_version` here, the engine server's weight_version,
reported with every response: agent_loop/manager.py records it per token as response_weight_versions; the
definition, the same in every schedule: data/batch_layout.py).
"""
from __future__ import annotations

import time

import ray

from hybridrl.single_controller.heartbeat import WorkerWatch
from hybridrl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from hybridrl.trainer.ppo.metric_utils import mean_of_rank_metrics
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from hybridrl.workers.rollout.async_server import WINDOW_METRICS


class DisaggregatedPPOTrainer(RayPPOTrainer):
    def __init__(self, config, run_control=None):
        """The config's hybrid_engine=false and rollout.mode=async (trainer/config_checks.py checked them)."""
        super().__init__(config, run_control)
        self.rollout_wg: RayWorkerGroup | None = None
        self.rollout_version: int | None = None  # the policy version every engine holds
        self.weight_metas: list = []

    # ------------------------------------------------------------------ set-up
    def init_workers(self):
        """The trainer pool's colocated roles, the rollout pool's engine servers, and the weight-transfer group
        between them; the engines then get the actor's initial weights (version 0) and start serving."""
        from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker

        self.resource_pool = self._create_resource_pools()
        self._spawn_trainer_pool("actor_ref" if self.use_reference else "actor")
        self.rollout_wg = RayWorkerGroup(
            resource_pool=self.resource_pool.pool_of("rollout"),
            ray_cls_with_init=RayClassWithInitArgs(ActorRolloutRefWorker, self.config.actor_rollout_ref,
                                                   self.policy_spec, role="rollout",
                                                   engine_load=self.rollout_engine_load(), **self.worker_init_args()),
            watch=WorkerWatch.from_trainer_config(self.config.trainer))
        self.rollout_wg.init_model()
        addresses = [address for address in self.rollout_wg.start_engine_server(  # TP: the groups' leaders serve
            [self.tokenizer.eos_token_id], self.tokenizer.pad_token_id) if address is not None]
        self._start_group_rollout(self._agent_loop_generate(addresses))
        self._init_weight_transfer()
        self.sync_weights()

    def _init_weight_transfer(self) -> None:
        """Trainer rank 0 and every rollout rank join one process group (gloo on CPU, NCCL on GPU)."""
        rollout = self.config.actor_rollout_ref.rollout
        # the engines hold rollout.dtype copies; hf generates from the exact weights
        wire_dtype = rollout.dtype if rollout.name in ("sglang", "vllm") else None
        self.weight_metas = self.actor_rollout_wg.describe_weights(wire_dtype)[0]
        address, port = self.actor_rollout_wg.weight_sender_address()[0]
        world_size = 1 + self.rollout_wg.world_size
        wait_together(self.actor_rollout_wg.init_weight_sender(address, port, world_size),
                      self.rollout_wg.init_weight_receiver(address, port, world_size, self.weight_metas,
                                                           rollout.update_weights_bucket_megabytes << 20))

    # ------------------------------------------------------------------ weights: trainer pool -> rollout pool
    def sync_weights(self) -> dict[str, float]:
        """Give every engine the actor's current weights unless it holds them already; timing_s/sync_weights and
        the parts' timings, and what the servers saw while they held the previous weights (async_server.
        window_metrics, the mean over the servers). The engines pause (finishing the requests under way) and resume
        around it."""
        version = self.weights_version()
        if version == self.rollout_version:
            return {}
        started = time.perf_counter()
        sent, received = wait_together(self.actor_rollout_wg.send_weights(self.weight_metas),
                                       self.rollout_wg.receive_weights(version))
        self.rollout_version = version
        metrics = {"timing_s/sync_weights": time.perf_counter() - started,
                   "timing_s/send_weights": sent[0]["timing_s/send_weights"],
                   "weight_sync/megabytes": sent[0]["weight_sync/megabytes"],
                   "timing_s/receive_weights": max(rank["timing_s/receive_weights"] for rank in received),
                   "timing_s/pause_engine": max(rank["timing_s/pause_engine"] for rank in received),
                   **mean_of_rank_metrics([{key: rank[key] for key in WINDOW_METRICS if key in rank}
                                           for rank in received])}
        return metrics

    def _rollout_mode(self) -> dict[str, float]:
        """The engines get the current weights (they never give their memory away: no switch)."""
        return self.sync_weights()

    def _trainer_mode(self) -> dict[str, float]:
        """Nothing: the rollout pool's devices are the engines' alone."""
        return {}


def wait_together(*futures) -> list:
    """The results of group calls that only finish together (both sides of a collective), in order. Whichever
    side fails first raises at once: the other would wait in the collective until its timeout."""
    pending = [ref for future in futures for ref in future.refs]
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)  # a worker's error, or a dead worker, surfaces here
    return [future.get() for future in futures]
