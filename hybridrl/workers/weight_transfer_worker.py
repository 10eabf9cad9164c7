"""The worker side of a disaggregated run (actor_rollout_ref.hybrid_engine=false): the trainer pool's actor ranks
send their weights, the rollout pool's rollout-only ranks receive them (protocol: rollout/weight_transfer.py).

Mixed into ActorRolloutRefWorker. The controller (trainer/ppo/placement.py) drives it:

    set-up   describe_weights() on the trainer group (the stream's names, dtypes, shapes), weight_sender_address()
             on it (rank 0's node and the port it reserved), then together
             init_weight_sender(addr, port, world) and init_weight_receiver(addr, port, world, metas, bucket_bytes)
             (joining the group blocks until every member has joined)
    update   together: send_weights(metas) on the trainer group, receive_weights(version) on the rollout group

receive_weights is the lock: the engine server stops answering (requests under way finish on the old weights; new
ones wait), every bucket is loaded, the engine gets `version`, and only then does the server answer again.
"""
from __future__ import annotations

import time

from hybridrl.single_controller import Dispatch, register
from hybridrl.utils.distributed import reserve_port
from hybridrl.workers.rollout.weight_sync import iter_rollout_weights
from hybridrl.workers.rollout.weight_transfer import (GROUP_NAME, TensorMeta, WeightTransferGroup, describe,
                                                      load_full_tensors, plan_buckets, receive_bucket, send_weights)


class WeightTransferMixin:
    """ActorRolloutRefWorker's weight-transfer methods (it provides rank, device, actor_module, rollout, ...)."""

    weight_group: WeightTransferGroup | None = None
    weight_buckets: list[list[TensorMeta]] = []

    # ------------------------------------------------------------------ trainer side
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe_weights(self, wire_dtype: str | None = None) -> list[TensorMeta]:
        """The metadata of the weight stream the rollout loads (every rank gathers; all return the same list);
        wire_dtype: the dtype tensors are sent in (None: the stream's own)."""
        self._require(self._is_actor, "describe_weights", "actor")
        with self.actor_offload.loaded():
            return describe(iter_rollout_weights(self.actor_module), wire_dtype)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_sender_address(self) -> tuple[str, int] | None:
        """Rank 0: its node's address and a port it listens on from now on, for the group's rendezvous, which it hosts
        (no other process can take the port before init_weight_sender). The other ranks: None."""
        if self.rank != 0:
            return None
        import ray

        address = ray.util.get_node_ip_address()
        return address, reserve_port(address)

    # rank 0 answers for all (they update together); not blocking, so that it can be asked with another call
    @register(dispatch_mode=Dispatch.RANK_ZERO, blocking=False)
    def current_weights_version(self) -> int:
        """The policy version this rank holds: training steps whose update produced its weights (rollout/
        batch_layout.py)."""
        return self.weights_version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)  # the other side joins at the same time
    def init_weight_sender(self, master_addr: str, master_port: int, world_size: int) -> None:
        """Trainer rank 0 joins the weight-transfer group as its rank 0 (and hosts its rendezvous)."""
        self._require(self._is_actor, "init_weight_sender", "actor")
        if self.rank == 0:
            self.weight_group = WeightTransferGroup(master_addr, master_port, 0, world_size, self._transfer_backend())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)  # the other side joins at the same time
    def send_weights(self, metas: list[TensorMeta]) -> dict[str, float]:
        """Broadcast the actor's current weights to every rollout rank; returns this rank's version and timings."""
        self._require(self._is_actor, "send_weights", "actor")
        self._require_trainer_mode("send_weights")
        started = time.perf_counter()
        with self.actor_offload.loaded():
            sent = send_weights(iter_rollout_weights(self.actor_module), metas, self.weight_group)
        return {"weights_version": self.weights_version, "timing_s/send_weights": time.perf_counter() - started,
                "weight_sync/megabytes": sent / 2**20}

    # ------------------------------------------------------------------ rollout side
    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)  # the other side joins at the same time
    def init_weight_receiver(self, master_addr: str, master_port: int, world_size: int, metas: list[TensorMeta],
                             bucket_bytes: int) -> None:
        """Rollout rank r joins the group as rank 1 + r: SGLang's engine itself (on a GPU), else this process."""
        self._require(self._is_rollout and not self._is_actor, "init_weight_receiver", "rollout (alone)")
        self.weight_buckets = plan_buckets(list(metas), bucket_bytes)
        engine_joins = getattr(self.rollout, "init_weights_update_group", None)
        if self.device == "cuda" and engine_joins is not None:
            engine_joins(master_addr, master_port, 1 + self.rank, world_size, GROUP_NAME)
        else:
            self.weight_group = WeightTransferGroup(master_addr, master_port, 1 + self.rank, world_size,
                                                    self._transfer_backend())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)  # the other side joins at the same time
    def receive_weights(self, version: int) -> dict[str, float]:
        """Pause serving, load every bucket the trainer broadcasts, serve again holding `version`. Returns the timings
        and what the server saw while it held the previous version (async_server.window_metrics)."""
        self._require(self._is_rollout and not self._is_actor, "receive_weights", "rollout (alone)")
        started = time.perf_counter()
        switch = self.mode_switch
        served = self.engine_server.pause() if self.engine_server is not None else {}
        paused = time.perf_counter()
        if switch.shares_trainer_weights and switch.in_rollout_mode:
            switch.trainer_mode()  # the hf engine generates from this worker's module: load into it sharded
        if not switch.shares_trainer_weights and not switch.in_rollout_mode:
            switch.rollout_mode(switch.engine_weights_version)  # the engine's memory back; nothing pushed
        for bucket in self.weight_buckets:
            if self.weight_group is None:  # SGLang receives from the group itself
                self.rollout.update_weights_from_distributed(bucket, group_name=GROUP_NAME)
                continue
            tensors = receive_bucket(bucket, self.weight_group, self.device)
            if switch.shares_trainer_weights:
                load_full_tensors(self.actor_module, tensors)
            else:
                self.rollout.update_weights(iter(tensors))
        self.weights_version = version
        if switch.shares_trainer_weights:
            switch.rollout_mode(version)
        else:
            switch.engine_weights_version = version
        if self.engine_server is not None:
            self.engine_server.serve(version)
        return {**served, "timing_s/receive_weights": time.perf_counter() - started,
                "timing_s/pause_engine": paused - started}

    def _transfer_backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"
