"""The parts of asynchronous training that need no trainer: resource pools and what they lack, the weight-transfer
group (a real gloo group of 3 members), the rollouter's staleness bound, and in-flight prompts in checkpoints."""
import os
import socket
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch

from hybridrl.agent_loop.manager import VersionRecorder
from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY
from hybridrl.config import ConfigError, compose_config, validate_config
from hybridrl.protocol import DataProto
from hybridrl.single_controller.resource_pool_manager import (ROLLOUT_POOL, TRAINER_POOL, pool_specs, role_mapping,
                                                              shortfalls)
from hybridrl.trainer.ppo.rollouter import Rollouter, prompts_from_plain, prompts_to_plain
from hybridrl.workers.rollout.weight_transfer import (TensorMeta, WeightTransferGroup, describe, plan_buckets,
                                                      receive_bucket, send_weights)

DISAGGREGATED = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.mode=async",
                 "data.return_raw_chat=true", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=2"]


# ---------------------------------------------------------------------- placement

def test_pools_and_role_mapping_follow_hybrid_engine():
    colocated = validate_config(compose_config([]))
    assert {name: spec.process_on_nodes for name, spec in pool_specs(colocated).items()} == {TRAINER_POOL: [2]}
    assert set(role_mapping(colocated).values()) == {TRAINER_POOL}
    split = validate_config(compose_config(DISAGGREGATED + ["rollout.nnodes=2"]))
    assert {name: spec.process_on_nodes for name, spec in pool_specs(split).items()} == {
        TRAINER_POOL: [1], ROLLOUT_POOL: [2, 2]}
    assert role_mapping(split) == {"actor": TRAINER_POOL, "critic": TRAINER_POOL, "rm": TRAINER_POOL,
                                   "rollout": ROLLOUT_POOL}


def test_shortfalls_name_the_pools_and_the_missing_amount():
    specs = pool_specs(validate_config(compose_config(DISAGGREGATED)))
    assert shortfalls(specs, use_gpu=True, cluster_total={"CPU": 16, "GPU": 3},
                      node_capacities=[{"CPU": 16, "GPU": 3}]) == []
    problems = shortfalls(specs, use_gpu=True, cluster_total={"CPU": 16, "GPU": 2},
                          node_capacities=[{"CPU": 8, "GPU": 1}, {"CPU": 8, "GPU": 1}])
    assert problems == [
        "the pools need 3 GPU in all (trainer_pool 1 (trainer.nnodes * trainer.n_gpus_per_node) + rollout_pool 2 "
        "(rollout.nnodes * rollout.n_gpus_per_node)), the Ray cluster has 2: 1 GPU short",
        "rollout_pool needs 2 GPU on one node (rollout.nnodes * rollout.n_gpus_per_node), the largest Ray node has "
        "1 GPU"]
    cpu_problems = shortfalls(specs, use_gpu=False, cluster_total={"CPU": 2}, node_capacities=[{"CPU": 2}])
    assert cpu_problems == ["the pools need 3 CPU in all (trainer_pool 1 (trainer.nnodes * trainer.n_gpus_per_node) "
                            "+ rollout_pool 2 (rollout.nnodes * rollout.n_gpus_per_node)), the Ray cluster has 2: "
                            "1 CPU short"]


@pytest.mark.parametrize("overrides, problem", [
    (["async_training.mode=one_step_off"], "async_training.mode: expected 'sync' with actor_rollout_ref.hybrid_engine"
                                           "=true"),
    (["actor_rollout_ref.hybrid_engine=false"], "actor_rollout_ref.rollout.mode: expected 'async' with "
                                                "actor_rollout_ref.hybrid_engine=false"),
    (DISAGGREGATED + ["async_training.mode=fully_async", "algorithm.adv_estimator=remax"],
     "algorithm.adv_estimator: expected an estimator without a greedy baseline rollout"),
    (DISAGGREGATED + ["async_training.max_staleness=-1"], "async_training.max_staleness"),
    (DISAGGREGATED + ["async_training.stale_samples=keep"], "async_training.stale_samples"),
])
def test_config_refuses_schedules_that_cannot_run(overrides, problem):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(overrides))
    assert any(line.startswith(problem) for line in err.value.problems), err.value.problems


# ---------------------------------------------------------------------- weight transfer over gloo

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _weights() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [("embed.weight", torch.randn(50, 8, generator=generator)),
            ("layers.0.weight", torch.randn(8, 8, generator=generator)),
            ("layers.0.bias", torch.randn(8, generator=generator)),
            ("head.weight", torch.randn(3, 8, generator=generator))]


def test_weights_reach_every_receiver_bucket_by_bucket_over_a_gloo_group():
    """Rank 0 sends, ranks 1 and 2 receive (three members of one real gloo group, here in threads of one process:
    each member has its own ProcessGroupGloo and sockets): every tensor arrives exactly, in bf16 when the metadata
    says so (the wire dtype of an engine that holds bf16)."""
    weights = _weights()
    metas = describe(weights, wire_dtype="bfloat16")
    assert metas[0] == TensorMeta("embed.weight", "bfloat16", (50, 8)) and metas[0].nbytes == 800
    buckets = plan_buckets(metas, bucket_bytes=900)
    assert [[meta.name for meta in bucket] for bucket in buckets] == [
        ["embed.weight"], ["layers.0.weight", "layers.0.bias", "head.weight"]]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = _free_port()
    received: dict[int, dict] = {}
    errors: list[BaseException] = []

    def receive(rank: int) -> None:
        try:
            group = WeightTransferGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=60)
            received[rank] = {name: tensor for bucket in buckets for name, tensor in receive_bucket(bucket, group,
                                                                                                  "cpu")}
        except BaseException as err:  # surfaced below
            errors.append(err)

    receivers = [threading.Thread(target=receive, args=(rank,)) for rank in (1, 2)]
    for thread in receivers:
        thread.start()
    group = WeightTransferGroup("127.0.0.1", port, 0, 3, "gloo", timeout_s=60)
    sent = send_weights(iter(weights), metas, group)
    for thread in receivers:
        thread.join(60)
    assert not errors, errors
    assert sent == sum(meta.nbytes for meta in metas)
    for rank in (1, 2):
        for name, tensor in weights:
            assert torch.equal(received[rank][name], tensor.to(torch.bfloat16)), (rank, name)


def test_sender_refuses_a_stream_that_changed_since_it_was_described():
    weights = _weights()
    metas = describe(weights)
    with pytest.raises(RuntimeError, match="tensor 1 is layers.0.bias"):
        send_weights(iter([weights[0], weights[2]]), metas, group=None)
    with pytest.raises(RuntimeError, match="ended after 2 tensors, the receivers expect 4"):
        send_weights(iter(weights[:2]), metas, group=None)


# ---------------------------------------------------------------------- versions of tokens

def test_version_recorder_gives_each_generated_token_its_calls_version():
    recorder = VersionRecorder(server_manager=None)
    recorder.calls = [(3, 4), (2, 5)]  # a first turn at version 4, a second (after an update) at 5
    assert recorder.token_versions([1, 1, 1, 0, 0, 1, 1]) == [4, 4, 4, -1, -1, 5, 5]


# ---------------------------------------------------------------------- the rollouter

class FakeEngine:
    """generate_group stand-in: answers after `delay` s with the current version on every token; `started[v]`
    counts the calls begun at version v (`begun` is notified at each)."""

    def __init__(self, delay: float = 0.01):
        self.version = 0
        self.delay = delay
        self.lock = threading.Lock()
        self.begun = threading.Condition(self.lock)
        self.started: Counter = Counter()

    def __call__(self, prompts: DataProto) -> DataProto:
        with self.lock:
            version = self.version
            self.started[version] += 1
            self.begun.notify_all()
        time.sleep(self.delay)
        rows = prompts.repeat(2, interleave=True)
        rows.batch[WEIGHT_VERSIONS_KEY] = torch.full((len(rows), 4), version, dtype=torch.long)
        return rows


def prompt_batches(count: int, size: int = 4):
    start = 0
    for _ in range(count):
        yield {"index": torch.arange(start, start + size), "extra_info": [{"index": i} for i in range(start,
                                                                                                    start + size)]}
        start += size


@pytest.mark.parametrize("stale_samples", ["drop", "requeue"])
def test_rollouter_never_hands_out_a_group_staler_than_the_bound(stale_samples):
    """Before each "update" the test waits until a group beyond the 4 handed out has begun at the current version,
    so groups do go stale whatever the threads' timing on a loaded machine (the rollouter keeps 8 going)."""
    engine = FakeEngine()
    rollouter = Rollouter(engine, prompt_batches(50), capacity=8, stale_samples=stale_samples)
    handed_out, stale = [], 0
    for version in range(6):
        groups, counts = rollouter.take(4, oldest_version=version)  # max_staleness 0
        assert all(group.oldest_version == version for group in groups)
        handed_out += [int(group.prompts.batch["index"][0]) for group in groups]
        stale += counts[f"async_training/{'dropped' if stale_samples == 'drop' else 'requeued'}_groups"]
        with engine.lock:
            assert engine.begun.wait_for(lambda: engine.started[version] > len(groups), timeout=120)
            engine.version += 1  # the "update": everything generated before is now one version stale
    rollouter.shutdown()
    assert stale > 0  # groups generated ahead during the "training" did go stale
    assert len(handed_out) == len(set(handed_out)) == 24
    if stale_samples == "requeue":  # nothing is lost: the first prompts all come back
        assert set(range(16)) <= set(handed_out) | {int(p.batch["index"][0]) for p in rollouter.pending_prompts()}


def test_in_flight_prompts_survive_a_checkpoints_plain_round_trip(tmp_path):
    prompts = DataProto.from_single_dict({
        "input_ids": torch.arange(6).view(2, 3),
        "raw_prompt": [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]],
        "extra_info": np.array([{"index": np.int64(3)}, {"index": np.int64(4)}], dtype=object),
        "uid": np.array(["a", "b"], dtype=object)})
    path = tmp_path / "data.pt"
    torch.save({"prompts": [prompts_to_plain(prompts)]}, path)
    loaded = prompts_from_plain(torch.load(path, weights_only=True)["prompts"][0])
    assert torch.equal(loaded.batch["input_ids"], prompts.batch["input_ids"])
    assert list(loaded.non_tensor_batch["raw_prompt"]) == [[{"role": "user", "content": "hi"}],
                                                           [{"role": "user", "content": "yo"}]]
    assert list(loaded.non_tensor_batch["extra_info"]) == [{"index": 3}, {"index": 4}]
    assert "uid" not in loaded.non_tensor_batch  # a requeued prompt is a new group


def test_engine_servers_check_each_requests_length_budget_and_refuse_a_repetition_penalty():
    from hybridrl.workers.rollout.engine_io import requested_max_tokens

    assert requested_max_tokens({}, 16, "hf") == 16
    assert requested_max_tokens({"max_new_tokens": 5}, 16, "sglang") == 5
    assert requested_max_tokens({"max_tokens": 7, "max_new_tokens": 5, "repetition_penalty": 1.0}, 16, "vllm") == 7
    for bad in (0, 17):
        with pytest.raises(ValueError, match=rf"^generate: max_tokens={bad}, expected 1..rollout.response_length=16$"):
            requested_max_tokens({"max_tokens": bad}, 16, "hf")
    with pytest.raises(ValueError, match="^the vllm engine server pins repetition_penalty to 1 "):
        requested_max_tokens({"repetition_penalty": 1.1}, 16, "vllm")
