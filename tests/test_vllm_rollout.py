"""The CPU-checkable parts of the vllm rollout: config -> engine and sampling arguments, the registry, and the
lifecycle bookkeeping (memory tags -> sleep levels, the memory check before a wake-up, weights pushed after a
level-2 sleep, the prefix-cache flush, engine failure -> EngineDiedError), plus the async engine's stepping and abort.

vLLM and the GPU cannot run here: `FakeVLLM` stands in at that boundary only (vllm.LLM / SamplingParams /
LLMEngine and torch.cuda's memory numbers); everything above it is the real code. The engine itself is
exercised in tests/gpu/test_engine_hybrid.py and test_engine_worker.py (their vllm params)."""
from __future__ import annotations

import asyncio
import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.models.spec import ModelSpec
from hybridrl.workers.rollout import vllm_rollout
from hybridrl.workers.rollout.base import get_rollout_class
from hybridrl.workers.rollout.engine_io import EngineDiedError, EngineMemoryError
from hybridrl.workers.rollout.vllm_async import VLLMAsyncEngine
from hybridrl.workers.rollout.vllm_rollout import VLLMRollout, engine_kwargs, sampling_params, sleep_level

GiB = 1 << 30
WEIGHTS, KV_CACHE = 2 * GiB, 10 * GiB


def replace(config, **changes):
    return dataclasses.replace(config, **changes)


# ---------------------------------------------------------------------- configuration mapping

def test_engine_kwargs_come_from_the_rollout_keys(engine_rollout_config):
    assert engine_kwargs(engine_rollout_config, "/models/q", seed=7) == {
        "model": "/models/q", "dtype": "bfloat16", "gpu_memory_utilization": 0.6, "load_format": "dummy",
        "tensor_parallel_size": 1, "max_model_len": 128, "max_num_seqs": 256, "max_num_batched_tokens": 8192,
        "enforce_eager": True, "enable_sleep_mode": True, "skip_tokenizer_init": True,
        "logprobs_mode": "processed_logprobs", "seed": 7, "disable_log_stats": True}
    assert engine_kwargs(replace(engine_rollout_config, max_model_len=4096), "/m", seed=0)["max_model_len"] == 4096


def test_engine_kwargs_vllm_adds_arguments_but_not_config_owned_ones(engine_rollout_config):
    def with_vllm(**kwargs):
        engine = dataclasses.replace(engine_rollout_config.engine_kwargs, vllm=kwargs)
        return replace(engine_rollout_config, engine_kwargs=engine)

    kwargs = engine_kwargs(with_vllm(enable_prefix_caching=False, attention_backend="TRITON_ATTN"), "/m", seed=0)
    assert kwargs["enable_prefix_caching"] is False and kwargs["attention_backend"] == "TRITON_ATTN"
    with pytest.raises(ValueError, match=r"sets \['gpu_memory_utilization'\].*rollout.gpu_memory_utilization"):
        engine_kwargs(with_vllm(gpu_memory_utilization=0.9), "/m", seed=0)
    with pytest.raises(ValueError, match=r"sets \['enable_sleep_mode'\]"):
        engine_kwargs(with_vllm(enable_sleep_mode=False), "/m", seed=0)


def test_sampling_params_for_training_validation_and_forced_greedy(engine_rollout_config):
    common = {"n": 1, "max_tokens": 28, "ignore_eos": False, "stop_token_ids": [5, 9], "min_p": 0.0,
              "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "detokenize": False,
              "logprobs": None, "flat_logprobs": True}
    assert sampling_params(engine_rollout_config, {}, [5, 9]) == {**common, "temperature": 0.7, "top_p": 0.9,
                                                                  "top_k": 50}
    greedy = {**common, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
    assert sampling_params(engine_rollout_config, {"validate": True}, [5, 9]) == greedy  # val_kwargs: do_sample false
    assert sampling_params(engine_rollout_config, {"do_sample": False}, [5, 9]) == greedy
    # the config's "top_k off" (-1) is vLLM's 0; logprobs=0 asks for the sampled token's log-prob only
    with_log_probs = replace(engine_rollout_config, top_k=-1, calculate_log_probs=True)
    assert sampling_params(with_log_probs, {}, [5]) == {
        **common, "stop_token_ids": [5], "temperature": 0.7, "top_p": 0.9, "top_k": 0, "logprobs": 0}
    # vLLM stops at stop_token_ids even with ignore_eos (H200, 2026-12-01: 261,275 of 512 x 512 tokens with
    # ignore_eos on, where SGLang made all 262,144): with ignore_eos none are sent
    assert sampling_params(replace(engine_rollout_config, ignore_eos=True), {}, [5, 9]) == {
        **common, "ignore_eos": True, "stop_token_ids": [], "temperature": 0.7, "top_p": 0.9, "top_k": 50}



def test_sampled_log_probs_read_vllms_flat_lists_and_refuse_entries_of_other_tokens():
    """flat_logprobs=True: vLLM's FlatLogprobs (vllm/logprobs.py) holds flat lists, one entry a position with
    logprobs=0; this stand-in has the attributes read (the real one is read on the GPU, test_engine_hybrid.py)."""
    class Flat(list):  # a sequence of positions, like FlatLogprobs
        def __init__(self, token_ids, logprobs):
            super().__init__([None] * len(token_ids))
            self.start_indices, self.token_ids, self.logprobs = list(range(len(token_ids))), token_ids, logprobs

    completion = SimpleNamespace(token_ids=[7, 3, 7], logprobs=Flat([7, 3, 7], [-0.25, -1.5, -0.125]))
    assert vllm_rollout.sampled_log_probs(completion, 0) == [-0.25, -1.5, -0.125]
    completion.logprobs = Flat([7, 4, 7], [-0.25, -1.5, -0.125])
    with pytest.raises(RuntimeError, match="flat log-probs of prompt row 2 are not of its sampled tokens"):
        vllm_rollout.sampled_log_probs(completion, 2)
    completion.logprobs = Flat([7, 3], [-0.25, -1.5])
    with pytest.raises(RuntimeError, match="3 tokens but 2 log-prob entries for prompt row 1"):
        vllm_rollout.sampled_log_probs(completion, 1)

def test_tags_map_to_sleep_levels():
    assert sleep_level(("kv_cache", "weights")) == 2
    assert sleep_level(("weights",)) == 2
    assert sleep_level(("kv_cache",)) == 1
    with pytest.raises(ValueError, match=r"unknown memory tags \['cuda_graph'\]"):
        sleep_level(("kv_cache", "cuda_graph"))


def test_vllm_is_a_registered_rollout_imported_without_vllm():
    assert get_rollout_class("vllm") is VLLMRollout


# ---------------------------------------------------------------------- the fake at vLLM's boundary

class FakeDevice:
    """torch.cuda's numbers for one 80 GiB GPU, moved by the fake engine's sleeps and wake-ups. As on the GPU, torch's
    allocated bytes count the engine's tensors from its start on, asleep or awake (vLLM's CuMem pool: a sleep unmaps
    their memory, the allocations stay)."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.total = 80 * GiB
        self.used_by_trainer = 0
        self.used_by_engine = 0
        self.allocated_by_engine = 0

    def free_and_total(self):
        return self.total - self.used_by_trainer - self.used_by_engine, self.total

    def allocated(self):
        return self.used_by_trainer + self.allocated_by_engine

    def return_cached(self):
        pass

    def synchronize(self):
        pass

    def used(self):
        return self.used_by_trainer + self.used_by_engine


class FakeModel:
    def __init__(self):
        self.loads: list[list[tuple[str, torch.Tensor]]] = []

    def load_weights(self, weights):
        self.loads.append(list(weights))
        return {name for name, _ in weights}


class FakeLLM:
    """vllm.LLM's sleep / wake_up / apply_model / generate / reset_prefix_cache, keeping the device's numbers."""

    device: FakeDevice
    fail_generate: Exception | None = None
    blocks_in_use = False  # a request holds KV blocks: vLLM's reset_prefix_cache refuses (returns False)

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.model = FakeModel()
        self.awake = {"weights", "kv_cache"}
        self.device.used_by_engine = WEIGHTS + KV_CACHE
        self.device.allocated_by_engine = WEIGHTS + KV_CACHE

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.awake = set()
        self.device.used_by_engine = 0

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))
        need = (WEIGHTS if "weights" in tags else 0) + (KV_CACHE if "kv_cache" in tags else 0)
        if self.device.free_and_total()[0] < need:
            raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp")
        self.awake |= set(tags)
        self.device.used_by_engine += need

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return not self.blocks_in_use

    def apply_model(self, func):
        self.calls.append(("apply_model",))
        return [func(self.model)]

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts)))
        if self.fail_generate is not None:
            raise self.fail_generate
        outputs = []
        for prompt in prompts:  # answers: the prompt's last token + 1, +2, then EOS (id 9), log-prob -0.5 each
            last = prompt["prompt_token_ids"][-1]
            tokens = [last + 1, last + 2, 9][:params["max_tokens"]]
            logprobs = [{token: SimpleNamespace(logprob=-0.5)} for token in tokens]
            completion = SimpleNamespace(token_ids=tokens, logprobs=logprobs, finish_reason="stop")
            outputs.append(SimpleNamespace(outputs=[completion]))
        return outputs


@pytest.fixture
def engine(monkeypatch, engine_rollout_config):
    """A VLLMRollout over the fake, built like the worker builds it (log-probs on, 1 MiB buckets)."""
    device = FakeDevice()
    llm_class = type("LLM", (FakeLLM,), {"device": device})
    monkeypatch.setattr(vllm_rollout, "load_vllm", lambda: SimpleNamespace(LLM=llm_class, SamplingParams=dict))
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)

    def build(**changes):
        config = replace(engine_rollout_config, calculate_log_probs=True, update_weights_bucket_megabytes=1, **changes)
        return VLLMRollout(config, model_config=ModelSpec(key="actor_rollout_ref.model", path="/no/such/model"), device_memory=device)
    return build


def prompts(rows: list[list[int]], width: int = 4) -> DataProto:
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for index, row in enumerate(rows):  # left-padded, as the trainer sends them
        ids[index, width - len(row):] = torch.tensor(row)
        mask[index, width - len(row):] = 1
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask},
                               meta_info={"eos_token_id": 9, "pad_token_id": 0})


def weights(count: int, mib: float):
    """`count` float32 tensors that are `mib` MiB each once cast to bfloat16."""
    numel = int(mib * (1 << 20)) // 2
    for index in range(count):
        yield f"model.layers.{index}.mlp.weight", torch.full((numel,), float(index), dtype=torch.float32)


# ---------------------------------------------------------------------- lifecycle bookkeeping

def test_start_measures_the_wake_up_sizes_and_rests_asleep(engine):
    rollout = engine()
    assert rollout.llm.kwargs["enable_sleep_mode"] is True and rollout.llm.kwargs["model"] == "/no/such/model"
    assert vllm_rollout.os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine core in this process
    assert rollout.llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",)), ("sleep", 2)]
    assert rollout.resume_bytes == {"weights": WEIGHTS, "kv_cache": KV_CACHE}
    assert rollout.awake_tags == set() and rollout.weights_stale


def test_mode_switch_order_pushes_weights_after_a_level_2_wake_up(engine):
    rollout = engine(multi_stage_wake_up=True)
    rollout.llm.calls.clear()
    rollout.resume(("weights",))
    assert rollout.llm.calls == [("wake_up", ("weights",))]
    rollout.resume(("kv_cache",))
    assert rollout.llm.calls[1:] == [("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    with pytest.raises(RuntimeError, match=r"weights were discarded \(sleep level 2\) and not pushed"):
        rollout.generate_sequences(prompts([[3, 4]]))

    rollout.update_weights(weights(5, mib=0.4))  # 0.4 MiB each as bfloat16: two per bucket of 1 MiB
    loads = rollout.llm.model.loads
    assert [[name.split(".")[2] for name, _ in bucket] for bucket in loads] == [["0", "1"], ["2", "3"], ["4"]]
    assert all(tensor.dtype == torch.bfloat16 for bucket in loads for _, tensor in bucket)
    assert loads[1][1][1][0].item() == 3.0 and loads[1][1][1].numel() == 0.4 * (1 << 20) // 2
    assert rollout.last_switch["sync_gib"] == pytest.approx(5 * 0.4 / 1024, rel=1e-3)

    output = rollout.generate_sequences(prompts([[3, 4], [7]]))
    assert output.batch["responses"][:, :3].tolist() == [[5, 6, 9], [8, 9, 9]]
    assert output.batch["rollout_log_probs"][:, :3].tolist() == [[-0.5] * 3, [-0.5] * 3]
    assert output.batch["response_mask"][:, :4].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]

    rollout.llm.calls.clear()
    rollout.release(("kv_cache", "weights"))
    assert rollout.llm.calls == [("sleep", 2)] and rollout.weights_stale and not rollout.weights_survive_release
    assert rollout.last_switch["rollout mode/device_used"] == 12 and rollout.last_switch[
        "trainer mode restored/device_used"] == 0
    with pytest.raises(RuntimeError, match=r"asleep \(awake: \[\]\)"):
        rollout.generate_sequences(prompts([[3]]))


def test_without_multi_stage_wake_up_the_kv_cache_wakes_with_the_weights(engine):
    rollout = engine()
    rollout.llm.calls.clear()
    rollout.resume(("weights",))
    rollout.update_weights(weights(1, mib=0.1))
    rollout.resume(("kv_cache",))
    assert rollout.llm.calls == [("wake_up", ("weights", "kv_cache")), ("apply_model",), ("reset_prefix_cache",)]


def test_releasing_only_the_kv_cache_sleeps_at_level_1_and_keeps_the_weights(engine):
    rollout = engine()
    rollout.resume(("weights", "kv_cache"))
    rollout.update_weights(weights(1, mib=0.1))
    rollout.llm.calls.clear()
    rollout.release(("kv_cache",))
    assert rollout.llm.calls == [("sleep", 1)] and not rollout.weights_stale
    rollout.resume(("weights", "kv_cache"))
    assert rollout.generate_sequences(prompts([[3]])).batch["responses"][0, :3].tolist() == [4, 5, 9]


def test_a_wake_up_without_room_fails_first_naming_the_numbers_and_keys(engine):
    rollout = engine()
    rollout.memory.used_by_trainer = 70 * GiB  # 10 GiB free: the weights fit, the KV cache (10 GiB + headroom) not
    rollout.llm.calls.clear()
    with pytest.raises(EngineMemoryError) as caught:
        rollout.resume(("weights",))
    message = str(caught.value)
    assert "resuming the vllm engine's ['weights', 'kv_cache'] needs 12.00 GiB, but only 10.00 GiB of 80.00 GiB" in message
    assert "the trainer holds 70.00 GiB allocated" in message  # not 82: the sleeping engine's tensors are not its
    assert rollout.allocator_bytes == WEIGHTS + KV_CACHE
    assert "actor_rollout_ref.rollout.gpu_memory_utilization (now 0.6)" in message and "param_offload=true" in message
    assert rollout.llm.calls == []  # refused before vLLM's allocator could fail
    rollout.memory.used_by_trainer = 0
    rollout.resume(("weights",))
    assert rollout.awake_tags == {"weights", "kv_cache"}


def test_a_partly_awake_engine_is_not_put_to_sleep_and_wakes_only_the_rest(engine):
    rollout = engine(multi_stage_wake_up=True)
    rollout.memory.used_by_trainer = 70 * GiB  # room for the weights, not for the KV cache
    rollout.resume(("weights",))
    with pytest.raises(EngineMemoryError):
        rollout.resume(("kv_cache",))
    rollout.llm.calls.clear()
    rollout.release(("kv_cache", "weights"))  # what the mode switch does after a failed rollout_mode
    assert rollout.llm.calls == [] and rollout.awake_tags == {"weights"}  # vLLM would ignore a sleep now
    rollout.memory.used_by_trainer = 0
    rollout.resume(("weights",))
    rollout.resume(("kv_cache",))
    assert rollout.llm.calls == [("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    assert rollout.llm.awake == {"weights", "kv_cache"}


def test_flush_cache_resets_the_prefix_cache_and_a_refused_reset_is_an_error(engine):
    rollout = engine()
    rollout.resume(("weights", "kv_cache"))
    rollout.llm.calls.clear()
    rollout.flush_cache()
    assert rollout.llm.calls == [("reset_prefix_cache",)]
    rollout.llm.blocks_in_use = True
    with pytest.raises(RuntimeError, match="reset_prefix_cache refused: some KV blocks are still in use"):
        rollout.flush_cache()
    with pytest.raises(RuntimeError, match="reset_prefix_cache refused"):  # the reset that ends every resume, too
        rollout.resume(("kv_cache",))


def test_free_cache_engine_false_never_sleeps_and_weights_survive(engine):
    rollout = engine(free_cache_engine=False)
    assert rollout.llm.calls == [] and rollout.weights_survive_release
    rollout.resume(("weights",))
    rollout.resume(("kv_cache",))
    rollout.release(("kv_cache", "weights"))
    assert rollout.llm.calls == [("reset_prefix_cache",)]
    assert rollout.generate_sequences(prompts([[3]])).batch["responses"][0, 0].item() == 4


def test_an_engine_failure_is_engine_died_error_now_and_on_every_later_call(engine):
    rollout = engine()
    rollout.resume(("weights", "kv_cache"))
    rollout.update_weights(weights(1, mib=0.1))
    rollout.llm.fail_generate = ValueError("prompt too long")
    with pytest.raises(ValueError, match="prompt too long"):  # a bad request is not a dead engine
        rollout.generate_sequences(prompts([[3]]))
    rollout.llm.fail_generate = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(EngineDiedError, match="vllm engine call generate failed: RuntimeError: CUDA error: an illegal"):
        rollout.generate_sequences(prompts([[3]]))
    with pytest.raises(EngineDiedError, match=r"sleep\(level=2\): the engine failed earlier: RuntimeError: CUDA"):
        rollout.release(("kv_cache", "weights"))
    rollout.llm.calls.clear()
    with pytest.raises(EngineDiedError, match="reset_prefix_cache: the engine failed earlier: RuntimeError: CUDA"):
        rollout.flush_cache()
    assert rollout.llm.calls == []  # refused before the failed engine is touched again


# ---------------------------------------------------------------------- tensor parallelism: each rank its shard

TP_WORLD = 4  # two TP groups of 2 gloo ranks: 0-1 and 2-3


class RecordingTPLLM(FakeLLM):
    """FakeLLM that also records what the external launcher reads at the engine's start (LOCAL_RANK, RANK) and the
    prompts of each generate call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.started_with = {key: vllm_rollout.os.environ.get(key) for key in ("LOCAL_RANK", "RANK")}
        self.generated: list[list[list[int]]] = []

    def generate(self, prompts, params, use_tqdm=True):
        self.generated.append([prompt["prompt_token_ids"] for prompt in prompts])
        return super().generate(prompts, params, use_tqdm)


def _tp_rank_main(rank: int, work_dir: str, config) -> None:
    """One rank of the trainer's world: its node-local LOCAL_RANK (as Ray sets it), its own torch seed, rank + 1
    prompts of its own, and a VLLMRollout with tensor_model_parallel_size=2 over the fake."""
    import json

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{work_dir}/pg", rank=rank, world_size=TP_WORLD)
    torch.manual_seed(100 + rank)
    device = FakeDevice()
    llm_class = type("LLM", (RecordingTPLLM,), {"device": device})
    vllm_rollout.load_vllm = lambda: SimpleNamespace(LLM=llm_class, SamplingParams=dict)
    rollout = VLLMRollout(replace(config, tensor_model_parallel_size=2, calculate_log_probs=True),
                          model_config=ModelSpec(key="actor_rollout_ref.model", path="/no/such/model"),
                          device_memory=device)
    rollout.resume(("weights",))
    rollout.update_weights(weights(1, mib=0.1))
    rollout.resume(("kv_cache",))
    output = rollout.generate_sequences(prompts([[10 * rank + i] for i in range(rank + 1)]))
    report = {"kwargs": {key: rollout.llm.kwargs[key] for key in ("tensor_parallel_size", "disable_custom_all_reduce",
                                                                  "distributed_executor_backend", "seed")},
              "started_with": rollout.llm.started_with, "local_rank_after": os.environ["LOCAL_RANK"],
              "initial_seed": torch.initial_seed() % (2**31), "generated": rollout.llm.generated,
              "responses": output.batch["responses"][:, 0].tolist(), "rows": len(output),
              "log_probs": output.batch["rollout_log_probs"][:, 0].tolist()}
    with open(os.path.join(work_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_reports(tmp_path_factory, engine_rollout_config) -> list[dict]:
    import json

    import torch.multiprocessing as mp

    work_dir = tmp_path_factory.mktemp("vllm_tp")
    mp.spawn(_tp_rank_main, args=(str(work_dir), engine_rollout_config), nprocs=TP_WORLD, join=True)
    return [json.loads((work_dir / f"rank{rank}.json").read_text()) for rank in range(TP_WORLD)]


def test_each_rank_starts_its_shard_through_the_external_launcher_on_its_own_device(tp_reports):
    """vLLM's external launcher takes cuda:LOCAL_RANK: a Ray worker's only device is its index 0, whatever its
    node-local rank; LOCAL_RANK is the worker's again after the start."""
    for rank, report in enumerate(tp_reports):
        assert report["kwargs"]["tensor_parallel_size"] == 2
        assert report["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert report["kwargs"]["disable_custom_all_reduce"] is True
        assert report["started_with"] == {"LOCAL_RANK": "0", "RANK": str(rank)}
        assert report["local_rank_after"] == str(rank)


def test_a_groups_engines_share_the_leaders_seed(tp_reports):
    seeds = [report["kwargs"]["seed"] for report in tp_reports]
    assert seeds == [tp_reports[0]["initial_seed"]] * 2 + [tp_reports[2]["initial_seed"]] * 2
    assert tp_reports[0]["initial_seed"] != tp_reports[1]["initial_seed"]  # the ranks' own seeds differed


def test_every_rank_of_a_group_generates_the_groups_prompts_and_keeps_its_own_rows(tp_reports):
    """Group 0-1: rank 0's prompt [0] then rank 1's [10], [11], on both ranks; group 2-3 the same with its own. The
    fake answers the prompt's last token + 1."""
    group_prompts = [[[0], [10], [11]], [[20], [21], [22], [30], [31], [32], [33]]]
    for rank, report in enumerate(tp_reports):
        assert report["generated"] == [group_prompts[rank // 2]]
        assert report["rows"] == rank + 1
        assert report["responses"] == [10 * rank + i + 1 for i in range(rank + 1)]
        assert report["log_probs"] == [-0.5] * (rank + 1)


# ---------------------------------------------------------------------- async engine (rollout.mode=async)

class FakeLLMEngine:
    """vllm's LLMEngine add_request / step / abort_request: one token per step (prompt's last + k), cumulative outputs."""

    def __init__(self):
        self.requests: dict[str, dict] = {}
        self.steps = 0

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = {"last": prompt["prompt_token_ids"][-1], "params": params, "tokens": []}

    def step(self):
        self.steps += 1
        outputs = []
        for request_id, request in list(self.requests.items()):
            request["tokens"].append(request["last"] + len(request["tokens"]) + 1)
            finished = len(request["tokens"]) == request["params"]["max_tokens"]
            completion = SimpleNamespace(token_ids=list(request["tokens"]), finish_reason="length" if finished else None,
                                         logprobs=[{token: SimpleNamespace(logprob=-1.0)} for token in request["tokens"]])
            outputs.append(SimpleNamespace(request_id=request_id, finished=finished, outputs=[completion]))
            if finished:
                del self.requests[request_id]
        return outputs

    def abort_request(self, request_ids):
        for request_id in request_ids:
            self.requests.pop(request_id, None)


def test_async_engine_batches_requests_by_stepping_and_aborts_with_partial_tokens(engine):
    rollout = engine()
    rollout.resume(("weights", "kv_cache"))
    rollout.update_weights(weights(1, mib=0.1))
    rollout.llm.llm_engine = FakeLLMEngine()
    server_engine = VLLMAsyncEngine(rollout, eos_token_ids=[9])
    assert server_engine.sampling_params({"temperature": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 3}) == {
        "n": 1, "max_tokens": 3, "ignore_eos": False, "stop_token_ids": [9], "min_p": 0.0, "repetition_penalty": 1.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "detokenize": False, "logprobs": 0, "flat_logprobs": True,
        "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    with pytest.raises(ValueError, match="max_tokens=29, expected 1..rollout.response_length=28"):
        server_engine.sampling_params({"max_tokens": 29})
    rollout.config = replace(rollout.config, ignore_eos=True)  # the server sends no stop tokens then, either
    assert server_engine.sampling_params({"max_tokens": 3})["stop_token_ids"] == []
    rollout.config = replace(rollout.config, ignore_eos=False)

    async def two_requests():
        return await asyncio.gather(
            server_engine.generate([1, 10], {"temperature": 1.0, "max_tokens": 3, "logprobs": True}),
            server_engine.generate([20], {"temperature": 0, "max_tokens": 2}))
    first, second = asyncio.run(two_requests())
    assert first == {"token_ids": [11, 12, 13], "stop_reason": "length", "log_probs": [-1.0, -1.0, -1.0]}
    assert second == {"token_ids": [21, 22], "stop_reason": "length", "log_probs": None}
    assert rollout.llm.llm_engine.steps == 3  # the two requests shared the engine's steps

    async def aborted_midway():
        request = asyncio.ensure_future(server_engine.generate([30], {"max_tokens": 20, "logprobs": True}))
        while not server_engine._latest:  # wait for its first steps
            await asyncio.sleep(0)
        await server_engine.abort()
        later = await server_engine.generate([40], {"max_tokens": 5})
        return await request, later
    partial, later = asyncio.run(aborted_midway())
    assert partial["stop_reason"] == "aborted" and partial["token_ids"][0] == 31 and len(partial["token_ids"]) < 20
    assert len(partial["log_probs"]) == len(partial["token_ids"])
    assert later == {"token_ids": [], "stop_reason": "aborted", "log_probs": None}
    assert rollout.llm.llm_engine.requests == {}


def test_async_engine_fails_pending_requests_when_a_step_fails(engine):
    rollout = engine()
    rollout.resume(("weights", "kv_cache"))
    rollout.update_weights(weights(1, mib=0.1))
    rollout.llm.llm_engine = FakeLLMEngine()
    rollout.llm.llm_engine.step = lambda: (_ for _ in ()).throw(RuntimeError("CUDA error: device-side assert"))
    server_engine = VLLMAsyncEngine(rollout, eos_token_ids=[9])
    with pytest.raises(EngineDiedError, match="vllm engine call step failed: RuntimeError: CUDA error"):
        asyncio.run(server_engine.generate([1], {"max_tokens": 2}))
    with pytest.raises(EngineDiedError, match="vllm engine: RuntimeError: CUDA error"):
        asyncio.run(server_engine.generate([1], {"max_tokens": 2}))
