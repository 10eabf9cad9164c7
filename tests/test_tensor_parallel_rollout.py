"""One engine per tensor-parallel group, driven by every rank of the group (rollout/tensor_parallel.py), on 6 gloo
ranks in 3 groups of 2: one that runs as it should, one whose engine fails on the leader, one with a GPU short of
room, started together (one spawn), so each fault is also shown to stay within its group. The engine is a recording
stand-in (SGLang and CUDA IPC cannot run here); what is real is the
choreography the trainer depends on: which rank builds the engine and with which GPUs, every rank's prompts
generated in one engine call and each rank's rows coming back to it, one payload per TP rank per weight bucket in
TP order with identical bucket boundaries, the leader's error reaching every rank of its group (never a rank left
waiting), a resume refused on every rank when any GPU of the group lacks room, and in rollout.mode=async one engine
server per group, on its leader, answering over HTTP from the group's engine. GPU proof: tests/gpu/ (issue 17).
"""
import asyncio
import json
import os
import types
import urllib.request

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridrl.protocol import DataProto
from hybridrl.workers.rollout.async_server import build_engine_server
from hybridrl.workers.rollout.engine_io import EngineMemoryError
from hybridrl.workers.rollout.tensor_parallel import EngineGroupError, TensorParallelRollout

WORLD, TP = 6, 2
# The fault each rank is started with (an environment variable the stand-ins below read); group 0 has none.
FAULTS = {2: "FAIL_RESUME", 3: "FAIL_RESUME", 5: "SHORT_GPU"}  # group 1: its engine; group 2: TP rank 1's GPU
# rank r sends r + 1 prompts [10r, 10r + 1, ...]; the engine answers prompt + 100
ALL_RESPONSES = [[10 * rank + 100 + i for i in range(rank + 1)] for rank in range(WORLD)]


class StandInSGLangEngine:
    """What SGLangAsyncEngine calls on sglang.Engine: its event loop and async_generate (prompt + 100, log-prob -0.5
    a token)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()

    async def async_generate(self, input_ids, sampling_params, return_logprob):
        output = [token + 100 for token in input_ids]
        return {"output_ids": output, "meta_info": {"finish_reason": {"type": "stop"},
                                                    "output_token_logprobs": [(-0.5, token, None) for token in output]}}


class RecordingEngine:
    """Stands in for SGLangRollout on the leader: records its calls, 'generates' prompt + 100 as the response."""

    def __init__(self, gpu_ids):
        self.gpu_ids, self.calls, self.payloads = gpu_ids, [], []
        self.engine, self.monitor = StandInSGLangEngine(), types.SimpleNamespace(cause=None)
        self.config = types.SimpleNamespace(response_length=8, ignore_eos=False)
        self.awake_tags: set[str] = set()
        self.distributed = []  # the rollout pool's weight-transfer calls (hybrid_engine=false)

    def resume_need(self, tags):
        return (3 << 30) * ("weights" in tags) + (5 << 30) * ("kv_cache" in tags)

    def resume(self, tags):
        self.calls.append(("resume", tags))
        if tags == ("kv_cache",) and os.environ.get("FAIL_RESUME"):
            raise RuntimeError("engine process scheduler_1 (pid 4242) died with exit code -9")
        self.awake_tags |= set(tags) | ({"cuda_graph"} if "kv_cache" in tags else set())  # SGLang's wake together

    def release(self, tags):
        self.calls.append(("release", tags))
        self.awake_tags -= set(tags) | ({"cuda_graph"} if "kv_cache" in tags else set())

    def update_weights_payloads(self, payloads):
        self.payloads.append(payloads)

    def init_weights_update_group(self, master_address, master_port, rank, world_size, group_name):
        self.distributed.append(["join", rank, world_size, group_name])

    def update_weights_from_distributed(self, bucket, group_name):
        self.distributed.append(["receive", bucket, group_name])

    def generate_sequences(self, prompts):
        self.calls.append(("generate", len(prompts)))
        return DataProto.from_dict({"input_ids": prompts.batch["input_ids"],
                                    "responses": prompts.batch["input_ids"] + 100})

    def take_metrics(self):
        return {"timing_s/engine_generate": 1.5}


class Bucket:
    """The FlatBucket contract (fits / add / take / metadata) on CPU, 8 elements per bucket."""

    def __init__(self):
        self.metadata, self.values = [], []

    def fits(self, tensor):
        return not self.metadata or sum(v.numel() for v in self.values) + tensor.numel() <= 8

    def add(self, name, tensor):
        self.metadata.append(name)
        self.values.append(tensor.flatten())

    def take(self):
        flat, metadata = torch.cat(self.values), self.metadata
        self.metadata, self.values = [], []
        return flat, metadata


class CPURollout(TensorParallelRollout):
    def new_bucket(self):
        return Bucket()

    @staticmethod
    def serialize(flat, metadata):
        return {"rank": dist.get_rank(), "names": metadata, "sum": float(flat.sum())}

    def device_memory(self):
        """80 GiB GPUs with 40 free; 8 bytes free on a rank started with SHORT_GPU."""
        free = 8 if os.environ.get("SHORT_GPU") else 40 << 30
        return free, 80 << 30, 30 << 30


def _rank_main(rank: int, work_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work_dir}/pg", rank=rank, world_size=WORLD)
    if rank in FAULTS:
        os.environ[FAULTS[rank]] = "1"
    config = types.SimpleNamespace(tensor_model_parallel_size=TP, free_cache_engine=True, gpu_memory_utilization=0.5,
                                   update_weights_bucket_megabytes=1, dtype="bfloat16")
    rollout = CPURollout(config, RecordingEngine, model_path=work_dir)  # no checkpoint there: the configured size
    report = {"rank": rank, "leader": rollout.tp.is_leader}
    try:
        rollout.resume(("weights",))
        weights = [(f"w{i}", torch.full((3,), float(i))) for i in range(5)]  # 15 elements: buckets of 2 + 2 + 1
        rollout.update_weights(iter(weights))
        rollout.resume(("kv_cache",))
    except (RuntimeError, EngineGroupError, EngineMemoryError) as err:
        report["resume_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    prompts = DataProto.from_dict({"input_ids": torch.arange(rank + 1).unsqueeze(1) + 10 * rank})
    output = rollout.generate_sequences(prompts)
    report["responses"] = output.batch["responses"].flatten().tolist()
    report["metrics"] = rollout.take_metrics()
    report.update(serve(rollout))
    rollout.init_weights_update_group("127.0.0.1", 29999, 1 + rank, 1 + WORLD, "weights")  # as the rollout pool
    rollout.update_weights_from_distributed(["w0", "w1"], "weights")
    rollout.release(("kv_cache", "weights"))
    if rollout.engine is not None:
        report.update(gpu_ids=rollout.engine.gpu_ids, calls=rollout.engine.calls, payloads=rollout.engine.payloads,
                      distributed=rollout.engine.distributed)
    with open(os.path.join(work_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def serve(rollout) -> dict:
    """rollout.mode=async: this rank's engine server, if any; the leader of group 0 (awake) answers one request."""
    server = build_engine_server(rollout, types.SimpleNamespace(name="sglang"), None, [7], 0, host="127.0.0.1")
    if server is None:
        return {"server": None}
    # The stand-in has SGLang's Engine.async_generate, not its tokenizer manager: each request on its own (admission
    # in batches runs on SGLang itself, tests/gpu/test_engine_async_server.py).
    server.engine.batch_admission = False
    seen = {"server": server.address}
    if dist.get_rank() == 0:
        server.serve(weight_version=3)
        body = json.dumps({"request_id": "r0", "prompt_ids": [5, 6], "sampling_params": {"logprobs": True}})
        request = urllib.request.Request(f"http://{server.address}/generate", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            seen["answer"] = json.loads(answer.read())
        seen["window_requests"] = server.pause()["rollout/server_requests"]
    server.shutdown()
    return seen


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """What each rank saw, in rank order."""
    work_dir = tmp_path_factory.mktemp("tp")
    mp.spawn(_rank_main, args=(str(work_dir),), nprocs=WORLD, join=True)
    return [json.loads((work_dir / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_the_first_rank_of_each_group_owns_the_engine_on_the_groups_devices(reports):
    assert [report["leader"] for report in reports] == [True, False] * 3
    assert [reports[leader]["gpu_ids"] for leader in (0, 2, 4)] == [["0", "1"]] * 3  # CPU: group ranks stand in
    assert all("gpu_ids" not in reports[rank] for rank in (1, 3, 5))


def test_each_group_generates_its_ranks_prompts_in_one_call_and_returns_each_rank_its_rows(reports):
    """Every group, the two with a fault included: a failed resume leaves the group answering later collectives."""
    assert [report["responses"] for report in reports] == ALL_RESPONSES
    assert ["generate", 3] in reports[0]["calls"] and ["generate", 7] in reports[2]["calls"]
    assert ["generate", 11] in reports[4]["calls"]
    assert all(report["metrics"] == {"timing_s/engine_generate": 1.5} for report in reports)


def test_each_bucket_reaches_the_engine_as_one_payload_per_tp_rank_in_tp_order(reports):
    for leader in (0, 2):  # group 2 was refused its resume before any weights moved
        payloads = reports[leader]["payloads"]
        assert [[p["names"] for p in bucket] for bucket in payloads] == [[["w0", "w1"]] * 2, [["w2", "w3"]] * 2,
                                                                          [["w4"]] * 2]
        assert [[p["rank"] for p in bucket] for bucket in payloads] == [[leader, leader + 1]] * 3
        assert [bucket[0]["sum"] for bucket in payloads] == [3.0, 15.0, 12.0]  # 3 x (0+1), 3 x (2+3), 3 x 4
    assert reports[0]["calls"] == [["resume", ["weights"]], ["resume", ["kv_cache"]], ["generate", 3],
                                   ["release", ["kv_cache", "weights"]]]


def test_an_engine_failure_on_the_leader_fails_every_rank_of_its_group(reports):
    assert reports[2]["resume_error"] == "RuntimeError: engine process scheduler_1 (pid 4242) died with exit code -9"
    assert reports[3]["resume_error"] == ("EngineGroupError: the rollout engine of ranks 2..3 failed on rank 2: "
                                          "RuntimeError: engine process scheduler_1 (pid 4242) died with exit code -9")
    assert "resume_error" not in reports[0] and "resume_error" not in reports[1]  # the other groups' engines resume
    assert reports[2]["calls"][:2] == [["resume", ["weights"]], ["resume", ["kv_cache"]]]


def test_a_resume_that_does_not_fit_one_gpu_of_the_group_is_refused_on_every_rank_of_that_group(reports):
    for rank in (4, 5):  # the need is the leader engine's number, checked against rank 5's GPU on both ranks
        assert reports[rank]["resume_error"].startswith(
            "EngineMemoryError: rollout mode: resuming the tensor-parallel sglang engine's ['weights'] needs 3.00 GiB "
            "on TP rank 1's GPU, but only 0.00 GiB of 80.00 GiB are free after the trainer returned its cached memory "
            "(the trainer holds 30.00 GiB allocated). Make room: lower "
            "actor_rollout_ref.rollout.gpu_memory_utilization (now 0.5)")
    assert ["resume", ["weights"]] not in reports[4]["calls"]  # refused before the engine was asked
    assert reports[4]["payloads"] == []  # nor were any weights sent


def test_in_async_mode_each_group_has_one_engine_server_on_its_leader_answering_from_the_groups_engine(reports):
    assert [report["server"] is not None for report in reports] == [True, False] * 3
    assert reports[0]["answer"] == {"token_ids": [105, 106], "stop_reason": "completed", "log_probs": [-0.5, -0.5],
                                    "weight_version": 3}
    assert reports[0]["window_requests"] == 1.0


def test_on_the_rollout_pool_each_groups_engine_joins_the_weight_transfer_group_once_for_its_ranks(reports):
    """SGLang's TP worker i joins as rank_offset + i: the leader's offset (1 + its rank) covers both members."""
    for leader in (0, 2, 4):
        assert reports[leader]["distributed"] == [["join", 1 + leader, 1 + WORLD, "weights"],
                                                  ["receive", ["w0", "w1"], "weights"]]
    assert all("distributed" not in reports[rank] for rank in (1, 3, 5))  # the other ranks join nothing
