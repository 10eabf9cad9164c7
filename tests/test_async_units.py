"""The parts of asynchronous training that need no trainer: resource pools and what they lack, the weight-transfer
group (a real gloo group of 3 members) and the data flow's stream under fully_async's staleness bound."""
import itertools
import os
import socket
import threading
from types import SimpleNamespace

import pytest
import torch

from hybridrl.agent_loop.manager import VersionRecorder
from hybridrl.config import ConfigError, compose_config, validate_config
from hybridrl.data.prompt_source import PromptSource
from hybridrl.data.sample import ABORTED, COMPLETED, PENDING, Sample
from hybridrl.single_controller.resource_pool_manager import (ROLLOUT_POOL, TRAINER_POOL, pool_specs, role_mapping,
                                                              shortfalls)
from hybridrl.trainer.ppo.group_rollout import GroupRollout
from hybridrl.trainer.ppo.group_stream import GroupStream
from hybridrl.trainer.ppo.placement import Colocated, SeparatePool, placement_for
from hybridrl.trainer.ppo.schedule import FullyAsync, OneStepOff, Sync, schedule_for
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
    (DISAGGREGATED + ["async_training.max_staleness=-1"], "async_training.max_staleness"),
    (DISAGGREGATED + ["async_training.stale_samples=keep"], "async_training.stale_samples"),
])
def test_config_refuses_schedules_that_cannot_run(overrides, problem):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(overrides))
    assert any(line.startswith(problem) for line in err.value.problems), err.value.problems


@pytest.mark.parametrize("schedule", ["one_step_off", "fully_async"])
def test_remax_runs_under_the_asynchronous_schedules(schedule):
    """ReMax's greedy baseline is a sample of each group of the data flow (generated with it), so every schedule
    takes it, partial rollout too; a custom rollout function is checked at run time for the groups' baselines."""
    config = validate_config(compose_config(DISAGGREGATED + [f"async_training.mode={schedule}",
                                                             "algorithm.adv_estimator=remax",
                                                             "data_flow.partial_rollout=true"]))
    assert (config.async_training.mode, config.algorithm.adv_estimator) == (schedule, "remax")


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


# ---------------------------------------------------------------------- the data flow's stream (fully_async)

class OneVersionEngine(GroupRollout):
    """GroupRollout whose engine calls (submit, wait, abort) stand in for the engine servers, everything else (the
    scoring, the filter, the counts) is GroupRollout's own: a group generates at the version the engines held when it
    was submitted (every token of that version; its samples score themselves, as an agent loop may), and groups
    finish in the order they were submitted, never during an update (the test's model of a slow rollout)."""

    def __init__(self, config):
        super().__init__(config, SimpleNamespace(report_failures=lambda errors, rows: None), tokenizer=None,
                         score_batch=None)
        self.version = 0
        self.in_engine: dict[int, tuple[list[Sample], int]] = {}  # by ref: the group and its version
        self._refs = itertools.count()

    def submit(self, group, evaluation=False):
        ref = next(self._refs)
        self.in_engine[ref] = (group, self.version)
        return ref

    def wait(self, refs):
        ref = min(refs)
        group, version = self.in_engine.pop(ref)
        for sample in group:
            sample.append([7, 7], None, version)
            sample.status, sample.reward = COMPLETED, 1.0
        return [(ref, group)]

    def abort(self, refs):
        """Each group back with one token of its version, aborted."""
        groups = [self.in_engine.pop(ref) for ref in refs]
        for group, version in groups:
            for sample in group:
                sample.append([7], None, version)
                sample.status = ABORTED
        return [group for group, _ in groups]


def toy_prompt_batches():
    start = 0
    while True:
        yield {"input_ids": torch.arange(start, start + 4).view(4, 1), "attention_mask": torch.ones(4, 1),
               "extra_info": [{"index": i} for i in range(start, start + 4)]}
        start += 4


def prompt_of(group) -> int:
    return group[0].metadata["extra_info"]["index"]


@pytest.mark.parametrize("stale_samples", ["drop", "requeue"])
def test_the_stream_never_hands_out_a_group_staler_than_the_bound(stale_samples):
    """fully_async's stream (max_staleness 0, 4 groups a step, 8 in flight): every group in flight at an update is
    one version stale when it finishes, so from step 2 on each step meets 8 stale groups, requeued (generated again,
    first: no prompt lost, each trained once, in data order) or dropped (counted; new prompts replace them)."""
    config = validate_config(compose_config(DISAGGREGATED + ["async_training.mode=fully_async",
                                                             "async_training.max_staleness=0",
                                                             f"async_training.stale_samples={stale_samples}",
                                                             "actor_rollout_ref.rollout.n=2"]))
    engine = OneVersionEngine(config)
    source = PromptSource(toy_prompt_batches, n=2, config=config)
    stream = GroupStream(engine, source, capacity=8, stale_samples=stale_samples)
    handed_out, stale_counts = [], []
    for step in range(1, 7):
        groups = stream.take(4, oldest_version=engine.version, step=step)
        assert [min(sample.token_versions) for group in groups for sample in group] == [engine.version] * 8
        handed_out.append([prompt_of(group) for group in groups])
        engine.version += 1  # the update: what is in flight is now one version stale
        with stream.weight_sync(step + 1):
            pass
        metrics = stream.step_metrics(groups)
        stale_counts.append(metrics[f"async_training/{'dropped' if stale_samples == 'drop' else 'requeued'}_groups"])
        assert metrics["data_flow/num_groups_trained"] == 4 and metrics["async_training/groups_ahead"] == 8
    assert stale_counts == [0, 8, 8, 8, 8, 8]
    if stale_samples == "requeue":  # generated again at the new version, before any new prompt
        assert handed_out == [list(range(4 * k, 4 * k + 4)) for k in range(6)]
    else:  # the 8 in flight at each update are lost, counted; the next 8 prompts replace them
        assert handed_out == [[0, 1, 2, 3]] + [list(range(12 * k, 12 * k + 4)) for k in range(1, 6)]
    in_flight = [prompt_of(group) for _, (group, _) in sorted(engine.in_engine.items())]
    stream.return_to_source()  # a checkpoint: the groups in flight go back to the buffer, reset (no partial rollout)
    assert [prompt_of(group) for group in source.buffer] == in_flight and len(in_flight) == 8
    assert all(sample.status == PENDING and not sample.response_ids for group in source.buffer for sample in group)


@pytest.mark.parametrize("overrides, placement, actor_role, schedule", [
    ([], Colocated, "actor_rollout", Sync),
    (DISAGGREGATED, SeparatePool, "actor", Sync),
    (DISAGGREGATED + ["async_training.mode=one_step_off"], SeparatePool, "actor", OneStepOff),
    (DISAGGREGATED + ["async_training.mode=fully_async", "actor_rollout_ref.actor.use_kl_loss=true"], SeparatePool,
     "actor_ref", FullyAsync),
])
def test_the_config_chooses_where_and_when_rollout_runs(overrides, placement, actor_role, schedule):
    """Where (hybrid_engine: the trainer's ranks or a pool of their own, whose trainer ranks hold no rollout) and when
    (async_training.mode) are two choices the one trainer is handed, made from the config in one place each."""
    config = validate_config(compose_config(overrides))
    chosen_placement = placement_for(config)
    chosen_schedule = schedule_for(config, OneVersionEngine(config), PromptSource(toy_prompt_batches, n=2,
                                                                                  config=config),
                                   chosen_placement, total_training_steps=4)
    try:
        assert (type(chosen_placement), type(chosen_schedule)) == (placement, schedule)
        assert chosen_placement.actor_role(config.actor_rollout_ref.actor.use_kl_loss) == actor_role
    finally:
        chosen_schedule.close()


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
