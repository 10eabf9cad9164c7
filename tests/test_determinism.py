"""verl's determinism keys: their pieces (request seeds, stable routing, the hf engine server's seeded requests, what
the keys refuse), and the CPU gate: two runs of one config with them on log bitwise-equal metrics.

The embedded default (`python -m hybridrl.main_ppo`: the built-in task, tiny model, hf rollout on 2 gloo ranks) and
the built-in tool task (`--config-name tool_default`: the tool agent loop against the ranks' HF engine servers, whose
requests arrive in whatever order the agent-loop workers send them), each 2 steps with validation before and after,
in this process on the module's local Ray. Every metric of metrics.jsonl must be equal to the bit, except the
wall-time and memory ones (NOT_COMPARED). A third run with another rollout.seed must sample other responses: the
comparison sees a change of the seed, so it is not comparing two things that cannot differ.
"""
import asyncio
import hashlib
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridrl.agent_loop.server_manager import AsyncLLMServerManager
from hybridrl.config import ConfigError, check_paths, compose_config, validate_config
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.workers.rollout.async_server import HFGenerateEngine
from hybridrl.data.prompt_source import PromptSource
from hybridrl.data.sample import COMPLETED, new_group
from hybridrl.workers.rollout.request_seeds import group_seeds, row_seed, turn_seed
from test_agent_loop import served
from test_data_flow import dataset_batches
from test_e2e_training import fit_once
from hybridrl.defaults.assets import ensure_default_assets
from hybridrl.defaults.tool_task import ensure_tool_task_assets
from hybridrl.trainer.ppo.group_rollout import GroupRollout
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer

KEYS_ON = ["actor_rollout_ref.rollout.full_determinism=true",
           "actor_rollout_ref.actor.fsdp_config.full_determinism=true",
           "actor_rollout_ref.ref.fsdp_config.full_determinism=true"]
# Left out of the comparison, and only these: what measures wall time (timing_s/*, the per-second rates, the tool
# calls' latency) or the host's memory in use (other processes share it); they differ between any two runs.
NOT_COMPARED = {"perf/throughput", "perf/time_per_step", "perf/mfu/actor", "perf/mfu/actor_infer", "perf/mfu/ref",
                "agent_loop/tool_latency_s/mean", "rollout/engine_tokens_per_s",
                "perf/cpu_memory_used_gb", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb"}
NOT_COMPARED_PREFIX = "timing_s/"


# ---- the pieces ----

def blake2_seed(*parts) -> int:
    """utils/determinism.stable_seed written out: the BLAKE2b-64 digest of the parts' repr, little-endian, mod 2**31."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") % 2**31


def test_a_requests_seed_is_its_rollout_seed_step_phase_row_and_turn():
    on, off = SimpleNamespace(full_determinism=True, seed=42), SimpleNamespace(full_determinism=False, seed=42)
    train = {"global_steps": 3, "validate": False}
    assert row_seed(on, train, 5) == blake2_seed(42, 3, "train", 5) == 1903007338
    assert row_seed(on, {"global_steps": 3, "validate": True}, 5) == blake2_seed(42, 3, "validate", 5)
    assert turn_seed(row_seed(on, train, 5), 0) == row_seed(on, train, 5)
    assert turn_seed(row_seed(on, train, 5), 2) == blake2_seed(blake2_seed(42, 3, "train", 5), 2)
    assert len({row_seed(on, train, row) for row in range(512)}) == 512
    assert row_seed(off, train, 5) is None
    with pytest.raises(ValueError, match=r"needs meta_info\['global_steps'\]"):
        row_seed(on, {"validate": False}, 5)


def test_an_agent_loop_samples_seed_is_its_row_in_the_step():
    """Row = the group's place among the groups its step submitted x n + the sample's place in the group (the row the
    batched engine call gives it too); a ReMax baseline (greedy) gets a seed of its group's own."""
    on, off = SimpleNamespace(full_determinism=True, seed=42), SimpleNamespace(full_determinism=False, seed=42)
    group = new_group({"raw_prompt_ids": [1, 2]}, n=3, group_index=17, first_index=51, baseline=True)
    seeds = group_seeds(on, 3, False, 2, group)
    assert seeds == [blake2_seed(42, 3, "train", 6), blake2_seed(42, 3, "train", 7), blake2_seed(42, 3, "train", 8),
                     blake2_seed(42, 3, "baseline", 2)]
    assert group_seeds(on, 3, True, 2, group)[0] == blake2_seed(42, 3, "validate", 6)
    assert group_seeds(off, 3, False, 2, group) == [None] * 4


def test_stable_routing_sends_a_request_id_to_the_same_server_whatever_the_load():
    servers = ["10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:3"]
    manager = AsyncLLMServerManager(servers, stable_routing=True)
    expected = {f"det-{row}": servers[blake2_seed(f"det-{row}") % 3] for row in range(12)}
    assert len(set(expected.values())) == 3  # the ids spread over the servers
    for loads in ((0, 0, 0), (9, 0, 0), (0, 5, 7)):
        manager.in_flight = dict(zip(servers, loads))
        assert {request_id: manager.choose_server(request_id) for request_id in expected} == expected


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    tokenizer = build_tokenizer(["a b c d e f g h i j say something about apple banana"] * 20, vocab_size=120)
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), tokenizer, hidden_size=32,
                                 num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), tokenizer


def test_a_seeded_request_gets_its_tokens_whatever_arrives_with_it(tiny_model):
    """The hf engine server generates a seeded request alone, from its seed: the same tokens in any arrival order;
    another seed samples other tokens."""
    model, tokenizer = tiny_model
    engine = HFGenerateEngine(model, response_length=8, eos_token_ids=[-1], pad_token_id=tokenizer.pad_token_id,
                              max_batch_size=64)
    server = served(engine)
    manager = AsyncLLMServerManager([server.address])
    prompts = {"apple": tokenizer("say something about apple")["input_ids"],
               "abc": tokenizer("a b c")["input_ids"], "banana": tokenizer("banana")["input_ids"]}
    seeds = {"apple": 11, "abc": 12, "banana": 13}
    sampled = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}

    async def tokens(order, seed_of):
        outputs = await asyncio.gather(*(manager.generate(
            name, prompt_ids=prompts[name], sampling_params={**sampled, "seed": seed_of[name]}) for name in order))
        return {name: output.token_ids for name, output in zip(order, outputs)}

    async def scenario():
        runs = [await tokens(["apple", "abc", "banana"], seeds), await tokens(["banana", "apple"], seeds),
                await tokens(["apple", "abc"], {**seeds, "apple": 99})]
        await manager.close()
        return runs

    try:
        forward, backward, reseeded = asyncio.run(scenario())
    finally:
        server.shutdown()
    assert engine.batch_sizes == [1] * 7  # every seeded request was generated alone
    assert all(len(ids) == 8 for ids in forward.values())
    assert backward == {name: forward[name] for name in ("banana", "apple")}
    assert reseeded["abc"] == forward["abc"] and reseeded["apple"] != forward["apple"]


def refusals(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config([*KEYS_ON, *overrides]))
    return [problem for problem in caught.value.problems if "full_determinism" in problem]


def test_the_keys_are_refused_where_generation_is_not_made_reproducible():
    validate_config(compose_config(KEYS_ON))  # the embedded default takes them
    assert refusals("data_flow.enable=true") == [
        "actor_rollout_ref.rollout.full_determinism: expected the data flow's features off (buffer, dynamic sampling, "
        "over-sampling, partial rollout, async schedules), got data_flow.enable=true (with them the groups a step "
        "trains are the first to finish, the stragglers aborted and buffered: which samples make a batch, and under an "
        "async schedule which weights generate them, depends on timing)"]
    [schedule] = refusals("async_training.mode=fully_async", "actor_rollout_ref.hybrid_engine=false",
                          "actor_rollout_ref.rollout.mode=async", "rollout.n_gpus_per_node=1",
                          "trainer.n_gpus_per_node=1", "data.return_raw_chat=true")[1:]
    assert "got async_training.mode='fully_async'" in schedule
    assert "algorithm.filter_groups.enable=true" in refusals("algorithm.filter_groups.enable=true")[0]
    assert refusals("actor_rollout_ref.rollout.tensor_model_parallel_size=2") == [
        "actor_rollout_ref.rollout.full_determinism: expected rollout.tensor_model_parallel_size=1 (a tensor-parallel "
        "group generates the prompts its ranks gather, whose request seeds are not carried with them), got 2"]


# ---- the gate ----

def run_steps(cache_dir, run_dir, *overrides, config_name: str = "ppo_trainer", steps: int = 2) -> list[dict]:
    """`steps` GRPO steps of the named built-in config with validation before and after; the metrics.jsonl lines."""
    config = validate_config(compose_config(
        [f"cache_dir={cache_dir}", f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
         f"trainer.test_freq={steps}", "trainer.logger=[console,jsonl]", "trainer.device=cpu", *overrides],
        config_name))
    ensure_default_assets(config)
    ensure_tool_task_assets(config)
    check_paths(config)
    fit_once(RayPPOTrainer(config))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def compared(lines: list[dict]) -> list[dict]:
    return [{key: value for key, value in line.items()
             if key not in NOT_COMPARED and not key.startswith(NOT_COMPARED_PREFIX)} for line in lines]


def assert_bitwise_equal(first: list[dict], second: list[dict]) -> None:
    """Same lines, same keys, and every value the same float bit for bit (NaN equal to NaN)."""
    assert len(first) == len(second)
    for line_a, line_b in zip(compared(first), compared(second)):
        assert sorted(line_a) == sorted(line_b)
        differ = {key: (line_a[key], line_b[key]) for key in line_a
                  if not (line_a[key] == line_b[key] or _both_nan(line_a[key], line_b[key]))}
        assert not differ, f"step {line_a.get('step')}: {differ}"


def training_only(line: dict) -> dict:
    """A step's line without its validation metrics (a 1-step run validates at step 1, a 2-step run does not)."""
    return {key: value for key, value in line.items() if not key.startswith(("val-core/", "val-aux/"))}


def _both_nan(a, b) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)


@pytest.fixture(scope="module")
def default_run(ray_local, builtin_cache, tmp_path_factory) -> list[dict]:
    """The embedded default with the keys on, 2 steps: the run the others are compared with."""
    return run_steps(builtin_cache, tmp_path_factory.mktemp("default_run"), *KEYS_ON)


def test_the_default_run_twice_with_the_keys_on_logs_bitwise_equal_metrics(default_run, builtin_cache, tmp_path):
    first = default_run
    second = run_steps(builtin_cache, tmp_path / "b", *KEYS_ON)
    assert [line["step"] for line in first] == [0, 1, 2]  # validation before, two steps (the last validates)
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean"):
        assert key in first[1] and key in first[2]
    assert any(key.startswith("val-core/") for key in first[0])
    assert_bitwise_equal(first, second)


def test_the_comparison_sees_another_rollout_seed(default_run, builtin_cache, tmp_path):
    reseeded = run_steps(builtin_cache, tmp_path / "c", *KEYS_ON, "actor_rollout_ref.rollout.seed=7", steps=1)
    assert compared(default_run)[0] == compared(reseeded)[0]  # validation before training is greedy: seeds do nothing
    with pytest.raises(AssertionError, match=r"step 1: \{.*'actor/pg_loss'"):  # other samples, another loss
        assert_bitwise_equal([training_only(default_run[1])], [training_only(reseeded[1])])


def test_the_tool_agent_run_twice_with_the_keys_on_logs_bitwise_equal_metrics(ray_local, builtin_cache, tmp_path):
    small = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.val_max_samples=8", "trainer.n_gpus_per_node=2"]
    first = run_steps(builtin_cache, tmp_path / "a", *KEYS_ON, *small, config_name="tool_default")
    second = run_steps(builtin_cache, tmp_path / "b", *KEYS_ON, *small, config_name="tool_default")
    assert first[1]["agent_loop/num_tool_calls/mean"] > 0  # the loop called its tool: turns were ordered, not one
    assert_bitwise_equal(first, second)


class FinishesLastFirst:
    """A generate function whose groups finish in the reverse of their submission (one token each), noting the step
    and place each group was submitted with."""

    def __init__(self):
        self.submitted: list[tuple[int, int, int]] = []  # (group_index, step, position)
        self.groups: dict[int, list] = {}

    def submit(self, group, sampling, baseline_sampling, step, position):
        self.submitted.append((group[0].group_index, step, position))
        for sample in group:
            sample.append([5], None, 0)
            sample.status = COMPLETED
        self.groups[len(self.groups)] = group
        return len(self.groups) - 1

    def wait(self, handles):
        last = max(handles)
        return [(last, self.groups[last])]

    def report_failures(self, errors, samples):
        assert not errors

    def take_engine_time(self):
        return 0.0, 0


def zero_rewards(batch, evaluation):
    """The reward manager's answer, every response scored 0 (the order test needs scored groups, not scores)."""
    return {"reward_tensor": torch.zeros(len(batch), 1)}


def test_the_flow_hands_the_step_its_groups_in_submission_order_not_finish_order(tmp_path):
    config = validate_config(compose_config([
        f"actor_rollout_ref.model.path={tmp_path}", "trainer.device=cpu", "data.train_batch_size=3",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", *KEYS_ON]))
    generator = FinishesLastFirst()
    rollout = GroupRollout(config, generator, tokenizer=SimpleNamespace(pad_token_id=0), score_batch=zero_rewards)
    groups, _ = rollout.train_groups(4, PromptSource(dataset_batches(), n=2, config=None))
    assert generator.submitted == [(0, 4, 0), (1, 4, 1), (2, 4, 2)]  # the step, and each group's place in it
    assert [group[0].group_index for group in groups] == [0, 1, 2]  # finished 2, 1, 0
