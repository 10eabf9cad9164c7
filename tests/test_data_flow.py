"""The data flow's parts without a trainer: Sample records and the one batch assembly, the prompt source and its
buffer (state saved and loaded bit for bit), the built-in filters, hook loading and its refusals at config
validation, and the HF engine server's abort (real HTTP on 127.0.0.1, a tiny real model)."""
import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from hybridrl.agent_loop.sample_generate import GenerateContext, generate, sample_from_loop
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager, abort_servers, reset_abort_servers
from hybridrl.config import compose_config, validate_config
from hybridrl.config.validation import ConfigError
from hybridrl.data import filters
from hybridrl.data.hooks import HookError, load_hook
from hybridrl.data.prompt_source import PromptSource
from hybridrl.data.route import data_flow_switch
from hybridrl.data.sample import ABORTED, COMPLETED, PENDING, TRUNCATED, Sample, groups_to_batch, partial_rollout_metrics, reset_group
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.agent_loop.base import TokenOutput
from hybridrl.workers.rollout.async_server import EngineServer, HFGenerateEngine
from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY


def scored_group(group_index, rewards, response=(7, 8, 9), version=0):
    return [Sample(group_index=group_index, index=group_index * 10 + i, prompt_ids=[1, 2], response_ids=list(response),
                   loss_mask=[1] * len(response), token_versions=[version] * len(response), reward=reward,
                   status="completed", metadata={"data_source": "toy", "extra_info": {"i": i}})
            for i, reward in enumerate(rewards)]


# ---------------------------------------------------------------------- samples and the batch assembly

def test_groups_to_batch_pads_once_and_puts_the_reward_on_the_last_trained_token():
    first = scored_group(3, [1.0, 0.0])
    first[1].response_ids, first[1].loss_mask, first[1].token_versions = [7, 8, 5, 6], [1, 1, 0, 0], [0, 0, 1, 1]
    second = scored_group(4, [{"acc": 0.5, "score": 2.0}, {"acc": 0.25, "score": 3.0}])
    for sample in second:
        sample.reward_key = "acc"
    second[0].metadata["reward_extra_info"] = {"acc": 0.5, "fmt": 1.0}  # the scorer's extras, as GDPO reads them
    batch = groups_to_batch([first, second], prompt_length=4, response_length=5, pad_token_id=0,
                            with_log_probs=False, scored=True)
    assert list(batch.non_tensor_batch["fmt"]) == [None, None, 1.0, None]  # a column per extra, None where none
    assert batch.batch["prompts"].tolist()[0] == [0, 0, 1, 2]
    assert batch.batch["responses"].tolist()[1] == [7, 8, 5, 6, 0]
    assert batch.batch["response_mask"].tolist()[1] == [1, 1, 0, 0, 0]
    scores = batch.batch["token_level_scores"]
    assert scores.tolist()[0] == [0, 0, 1.0, 0, 0]
    assert scores[1].abs().sum() == 0  # reward 0 on token 1, the last trained one
    assert scores.sum(-1).tolist() == [1.0, 0.0, 0.5, 0.25]  # dict rewards: reward_key's value
    assert batch.non_tensor_batch["uid"].tolist() == ["3", "3", "4", "4"]
    assert batch.non_tensor_batch["extra_info"][1] == {"i": 1}
    assert batch.batch[WEIGHT_VERSIONS_KEY].tolist()[1] == [0, 0, 1, 1, -1]
    stale_masked = groups_to_batch([first], prompt_length=4, response_length=5, pad_token_id=0, with_log_probs=False,
                                   scored=False, current_version=1, mask_stale_tokens=True)
    assert stale_masked.batch["response_mask"].tolist() == [[0, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert "token_level_scores" not in stale_masked.batch


def test_sample_records_survive_torch_save_with_weights_only(tmp_path):
    sample = scored_group(1, [0.5])[0]
    with pytest.raises(ValueError, match="log-probs given for some generate calls but not all"):
        sample.append([11, 12], [-0.5, -1.25], version=3)  # its first 3 tokens came without log-probs
    sample = scored_group(1, [0.5])[0]
    sample.append([11, 12], None, version=3)
    sample.append([13], None, version=4)
    path = tmp_path / "s.pt"
    torch.save(sample.to_dict(), path)
    loaded = Sample.from_dict(torch.load(path, weights_only=True))
    assert loaded == sample and loaded.token_versions == [0, 0, 0, 3, 3, 4]
    batch = groups_to_batch([[loaded, scored_group(2, [1.0])[0]]], prompt_length=4, response_length=8, pad_token_id=0,
                            with_log_probs=False, scored=False)
    assert partial_rollout_metrics(batch, current_version=4) == {
        "data_flow/partial_ratio": 0.5, "data_flow/staleness/mean": 4.0, "data_flow/staleness/max": 4.0}


class AnsweringServers:
    """The server manager at its boundary: every answer is `answer`."""
    def __init__(self, answer: TokenOutput):
        self.answer = answer

    async def generate(self, request_id, prompt_ids, sampling_params):
        return self.answer


def test_generate_records_the_version_the_engine_reports_and_refuses_an_answer_without_one():
    ctx = GenerateContext(server_manager=AnsweringServers(TokenOutput(token_ids=[5, 6], stop_reason="completed",
                                                                      weight_version=7)),
                          tokenizer=None, config=None, response_length=8)
    sample = asyncio.run(generate(ctx, Sample(group_index=0, index=0, prompt_ids=[1, 2]), {}))
    assert sample.response_ids == [5, 6] and sample.token_versions == [7, 7] and sample.status == "completed"
    ctx.server_manager = AnsweringServers(TokenOutput(token_ids=[5], stop_reason="completed"))
    with pytest.raises(RuntimeError, match="without a weight_version"):
        asyncio.run(generate(ctx, Sample(group_index=0, index=1, prompt_ids=[1, 2]), {}))


# ---------------------------------------------------------------------- the prompt source

def dataset_batches(num_batches=3, batch_size=3):
    """Collated batches as the training dataloader gives them: tensors plus numpy object columns."""
    def batches():
        for b in range(num_batches):
            rows = range(b * batch_size, (b + 1) * batch_size)
            column = np.empty(batch_size, dtype=object)
            for position, row in enumerate(rows):
                column[position] = {"index": row}
            yield {"input_ids": torch.ones(batch_size, 4, dtype=torch.long),
                   "attention_mask": torch.ones(batch_size, 4, dtype=torch.long),
                   "raw_prompt_ids": np.array([[row, row + 1] for row in rows] + [None], dtype=object)[:-1],
                   "extra_info": column, "data_source": np.array(["toy"] * batch_size, dtype=object)}
    return batches


def test_prompt_source_takes_the_buffer_first_then_the_data_and_resumes_exactly():
    source = PromptSource(dataset_batches(), n=2, config=None)
    first = source.get_groups(2, step=1)
    assert [group[0].prompt_ids for group in first] == [[0, 1], [1, 2]]
    assert [sample.index for group in first for sample in group] == [0, 1, 2, 3]
    first[1][0].append([9, 9], None, version=0)
    first[1][0].status = ABORTED
    source.add_groups([first[1]])
    with pytest.raises(ValueError, match="2 samples .rollout.n. of one prompt"):
        source.add_groups([first[0][:1]])

    state = source.state_dict()
    resumed = PromptSource(dataset_batches(), n=2, config=None)
    resumed.load_state_dict(torch.load(_saved(state), weights_only=True))
    # skip the batch the first source already drew (the trainer's TrainDataPosition does this on resume)
    resumed._batches = dataset_batches(3)()
    next(resumed._batches)
    for current in (source, resumed):
        groups = current.get_groups(3, step=2)
        assert groups[0][0].response_ids == [9, 9] and groups[0][0].status == ABORTED  # the buffer first
        assert [group[0].prompt_ids for group in groups] == [[1, 2], [2, 3], [3, 4]]  # then row 2, then batch 2
        assert groups[2][0].index == 6 and groups[2][0].metadata == {"extra_info": {"index": 3}, "data_source": "toy"}


def test_the_sources_samples_hold_plain_values_each_its_own_metadata():
    """numpy columns become plain Python once, when the rows are read (prompt_source._rows), not again per group:
    the samples' prompts are lists of ints, their metadata dicts of plain values, and no two samples share one."""
    source = PromptSource(dataset_batches(num_batches=1, batch_size=1), n=2, config=None)
    source.prefetch()
    (group,) = source.get_groups(1, step=1)
    assert [sample.prompt_ids for sample in group] == [[0, 1], [0, 1]]
    assert all(type(token) is int for sample in group for token in sample.prompt_ids)
    assert group[0].metadata == {"extra_info": {"index": 0}, "data_source": "toy"}
    assert type(group[0].metadata["data_source"]) is str and type(group[0].metadata["extra_info"]["index"]) is int
    group[0].metadata["extra_info"]["index"] = 5
    assert group[1].metadata["extra_info"] == {"index": 0}


def test_a_prefetched_batch_hands_out_the_same_groups_and_is_saved_as_pending_rows():
    plain, ahead = PromptSource(dataset_batches(), n=2, config=None), PromptSource(dataset_batches(), n=2, config=None)
    for step in (1, 2, 3):
        expected = [sample.to_dict() for group in plain.get_groups(3, step) for sample in group]
        assert [sample.to_dict() for group in ahead.get_groups(3, step) for sample in group] == expected
        ahead.prefetch()  # the next batch (none after the third) is read on a thread
        if step == 1:  # a checkpoint now holds the read-ahead batch's rows as pending: rows 3, 4, 5
            assert [row["extra_info"]["index"] for row in ahead.state_dict()["pending_rows"]] == [3, 4, 5]
    assert ahead.get_groups(3, step=4) == [] == plain.get_groups(3, step=4)  # the 3 batches are used up

    def bad_batches():
        raise ValueError("data.train_files row 7: no prompt")
        yield
    failing = PromptSource(bad_batches, n=2, config=None)
    failing.prefetch()  # the error waits for the step that needs the rows, and names the row
    with pytest.raises(ValueError, match="row 7: no prompt"):
        failing.get_groups(1, step=1)


def _saved(state):
    import io
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_a_buffer_filter_picks_which_buffered_groups_are_taken():
    def newest_first(config, step, buffer, num_groups):
        return list(reversed(buffer))[:num_groups]

    source = PromptSource(dataset_batches(), n=1, config=None, buffer_filter=newest_first)
    source.add_groups([scored_group(i, [1.0]) for i in range(3)])
    assert [group[0].group_index for group in source.get_groups(2, step=1)] == [2, 1]
    assert [group[0].group_index for group in source.buffer] == [0]


# ---------------------------------------------------------------------- built-in filters

def test_builtin_filters():
    flat, spread, wide = scored_group(0, [1.0, 1.0]), scored_group(1, [0.0, 0.5]), scored_group(2, [0.0, 1.0])
    assert not filters.check_reward_nonzero_std(None, flat) and filters.check_reward_nonzero_std(None, spread)
    assert filters.sort_by_reward_std(None, [flat, spread, wide]) == [wide, spread, flat]
    assert filters.pop_first(None, 1, [flat, spread], 1) == [flat]
    for sample, acc in zip(flat, [0.0, 1.0]):
        sample.metadata["reward_extra_info"] = {"acc": acc}
    assert filters.metric_nonzero_std("acc")(None, flat) and not filters.metric_nonzero_std("score")(None, flat)


# ---------------------------------------------------------------------- hooks and their validation

HOOK_FILE = '''
async def my_generate(ctx, sample, sampling_params):
    return sample

def not_async_generate(ctx, sample, sampling_params):
    return sample

def keep_all(config, group):
    return True

def too_few(config):
    return True
'''


def flow_config(tmp_path, *overrides):
    return compose_config([f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.mode=async",
                           "data.return_raw_chat=true", "actor_rollout_ref.actor.strategy=fsdp2",
                           "trainer.device=cpu", "data_flow.enable=true", *overrides])


@pytest.mark.parametrize("override, message", [
    ("data_flow.dynamic_sampling_filter.path={missing}", r"data_flow\.dynamic_sampling_filter: cannot load 'keep_all'"),
    ("data_flow.dynamic_sampling_filter.name=nope", r"data_flow\.dynamic_sampling_filter: cannot load 'nope'.*"
                                                    r"defines no 'nope'"),
    ("data_flow.dynamic_sampling_filter.name=too_few", r"data_flow\.dynamic_sampling_filter: expected `def f\(config, "
                                                       r"group\)` \(2 positional parameters\), too_few\(config\)"),
    ("data_flow.custom_generate_function.name=not_async_generate",
     r"data_flow\.custom_generate_function: expected an async function"),
    ("data_flow.buffer_filter.name=pop_last", None),
])
def test_bad_hooks_are_refused_at_validation_naming_the_key(tmp_path, override, message):
    hook_file = tmp_path / "hooks.py"
    hook_file.write_text(HOOK_FILE)
    hook = override.split(".")[1]
    overrides = [f"data_flow.{hook}.path={hook_file}", f"data_flow.{hook}.name=keep_all", override.format(
        missing=tmp_path / "missing.py")]
    if message is None:  # a built-in name that does not exist
        overrides = [override]
        message = r"data_flow\.buffer_filter\.name: expected a built-in \(check_reward_nonzero_std, pop_first, " \
                  r"sort_by_reward_std\) when data_flow\.buffer_filter\.path is null, got 'pop_last'"
    with pytest.raises(ConfigError, match=message):
        validate_config(flow_config(tmp_path, *overrides))


def test_good_hooks_load_and_data_flow_keys_are_refused_while_it_is_off(tmp_path):
    hook_file = tmp_path / "hooks.py"
    hook_file.write_text(HOOK_FILE)
    config = validate_config(flow_config(tmp_path, f"data_flow.custom_generate_function.path={hook_file}",
                                         "data_flow.custom_generate_function.name=my_generate",
                                         "data_flow.dynamic_sampling_filter.name=check_reward_nonzero_std"))
    assert load_hook("custom_generate_function", config.data_flow.custom_generate_function).__name__ == "my_generate"
    assert load_hook("dynamic_sampling_filter", config.data_flow.dynamic_sampling_filter) is \
        filters.check_reward_nonzero_std
    with pytest.raises(HookError, match="data_flow.over_sampling_filter.name: expected the function's name"):
        load_hook("over_sampling_filter", {"path": str(hook_file), "name": None})
    with pytest.raises(ConfigError) as refused:
        validate_config(flow_config(tmp_path, "data_flow.enable=false", "data_flow.partial_rollout=true",
                                    "data_flow.buffer_filter.name=pop_first"))
    assert refused.value.problems == [
        "data_flow.partial_rollout: expected False with data_flow.enable=false (it acts only in the data flow; set "
        "data_flow.enable=true), got True",
        "data_flow.buffer_filter: expected null path and name with data_flow.enable=false (set data_flow.enable=true), "
        "got {'path': None, 'name': 'pop_first'}"]
    # verl's DAPO keys in the default rollout.mode=sync: the flow generates by the engines' batched call, so FSDP1 with
    # hf and no raw chat are fine; a custom generate function is handed the engine servers, whose checks then apply
    config = validate_config(flow_config(tmp_path, "data_flow.enable=false", "algorithm.filter_groups.enable=true",
                                         "actor_rollout_ref.rollout.mode=sync", "data.return_raw_chat=false",
                                         "actor_rollout_ref.actor.strategy=fsdp"))
    assert config.algorithm.filter_groups.enable and config.actor_rollout_ref.actor.strategy == "fsdp"
    with pytest.raises(ConfigError) as refused:
        validate_config(flow_config(tmp_path, "actor_rollout_ref.rollout.mode=sync", "data.return_raw_chat=false",
                                    "actor_rollout_ref.actor.strategy=fsdp",
                                    f"data_flow.custom_generate_function.path={hook_file}",
                                    "data_flow.custom_generate_function.name=my_generate"))
    assert refused.value.problems == [
        "actor_rollout_ref.actor.strategy: expected 'fsdp2' with data_flow.custom_generate_function (it is handed the "
        "engine servers) and rollout.name='hf' (each rank's server generates on its own schedule; FSDP1 may gather "
        "layers at every step, a collective the ranks would not join together), got 'fsdp'"]


# ---------------------------------------------------------------------- abort on the HF engine server

HELD_AT_FORWARD = 4  # the abort comes while the first request's 4th forward (its 4th token) is held


class HoldAtForward:
    """A forward hook that, once armed, holds the model inside its `at`-th forward after arming (setting `held`)
    until `release` is set: the test acts while a generation is certainly under way, whatever the machine's load."""

    def __init__(self, at: int = 0):
        self.at, self.count, self.armed = at, 0, False
        self.held, self.release = threading.Event(), threading.Event()

    def arm(self, at: int | None = None) -> None:
        """Hold at the `at`-th forward from now (the one given at construction when None)."""
        self.at = self.at if at is None else at
        self.count, self.armed = 0, True
        self.held.clear()
        self.release.clear()

    def __call__(self, *args) -> None:
        if not self.armed:
            return
        self.count += 1
        if self.count == self.at:
            self.armed = False
            self.held.set()
            if not self.release.wait(120):  # only a broken test waits this long
                raise RuntimeError("HoldAtForward: never released")


class CountingEngine(HFGenerateEngine):
    """Counts the requests that reached the engine. A request is queued in the same step of the server's loop that
    counts it (no await between), so a later abort, handled on that loop, finds it queued."""

    received = 0

    async def generate(self, prompt_ids, sampling_params):
        self.received += 1
        return await super().generate(prompt_ids, sampling_params)


@pytest.fixture(scope="module")
def held_tiny_model(tmp_path_factory):
    """A tiny real model with a HoldAtForward hook (disarmed until a test arms it)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer(["a b c d e f g h i j say something about apple banana"] * 20, vocab_size=120)
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), tokenizer, hidden_size=32,
                                 num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    hold = HoldAtForward(HELD_AT_FORWARD)
    model.register_forward_hook(hold)
    return model, tokenizer, hold


def test_hf_server_abort_stops_generation_and_returns_the_tokens_so_far(held_tiny_model):
    """Request "a" is held inside a forward of its generation, "b" is queued behind it (max_batch_size=1), then
    the abort comes: an order of events the test makes sure of (no timer racing the generation), so "a" stops at
    exactly the token it was generating and "b" never starts."""
    model, tokenizer, hold = held_tiny_model
    engine = CountingEngine(model, response_length=200, eos_token_ids=[-1],  # no EOS: only the abort stops it
                            pad_token_id=tokenizer.pad_token_id, max_batch_size=1)
    server = EngineServer(engine, "127.0.0.1")
    server.serve()
    manager = AsyncLLMServerManager([server.address])
    prompt = tokenizer("say something about apple")["input_ids"]
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    async def abort_one_generating_and_one_queued():
        hold.arm()
        running = asyncio.create_task(manager.generate("a", prompt_ids=prompt, sampling_params=params))
        assert await asyncio.to_thread(hold.held.wait, 120), "request a never reached its held forward"
        queued = asyncio.create_task(manager.generate("b", prompt_ids=prompt, sampling_params=params))
        deadline = time.monotonic() + 120  # only a broken server waits this long
        while engine.received < 2:
            assert time.monotonic() < deadline, "request b never reached the engine"
            await asyncio.sleep(0.01)
        await asyncio.to_thread(abort_servers, [server.address])
        hold.release.set()
        return await running, await queued

    async def generate_one():
        try:
            return await manager.generate("c", prompt_ids=prompt, sampling_params=params)
        finally:
            await manager.close()

    try:
        running, queued = asyncio.run(abort_one_generating_and_one_queued())
        asyncio.run(manager.close())
        after = asyncio.run(generate_one())  # until the next rollout mode, every request answers aborted at once

        async def short(request_id):
            manager_again = AsyncLLMServerManager([server.address])
            try:
                return await manager_again.generate(request_id, prompt_ids=prompt,
                                                    sampling_params={**params, "max_tokens": 3})
            finally:
                await manager_again.close()
        reset_abort_servers([server.address])  # the data flow's reset once its stragglers are back
        reset = asyncio.run(short("d"))
        abort_servers([server.address])
        server.pause()
        server.serve()  # the next rollout mode clears the abort too
        fresh = asyncio.run(short("e"))
    finally:
        hold.release.set()  # a failed test never leaves the generate thread held
        server.shutdown()
    assert running.stop_reason == "aborted" and len(running.token_ids) == HELD_AT_FORWARD  # of 200
    assert len(running.log_probs) == len(running.token_ids)
    assert queued.stop_reason == "aborted" and queued.token_ids == [] and queued.log_probs == []
    assert after.stop_reason == "aborted" and after.token_ids == []
    assert fresh.stop_reason == "length" and fresh.token_ids == running.token_ids[:3]  # greedy: the same start
    assert reset.stop_reason == "length" and reset.token_ids == running.token_ids[:3]

    # the built-in generate function continues an aborted sample from its tokens so far
    sample = Sample(group_index=0, index=0, prompt_ids=list(prompt))
    sample.append(running.token_ids, running.log_probs, version=0)
    sample.status, sample.num_aborts = ABORTED, 1
    engine = HFGenerateEngine(model, response_length=200, eos_token_ids=[-1], pad_token_id=tokenizer.pad_token_id,
                              max_batch_size=1)
    server = EngineServer(engine, "127.0.0.1")
    server.serve(weight_version=1)  # the rollout worker serves its weights' version (workers/actor_rollout_ref.py)
    manager = AsyncLLMServerManager([server.address])
    budget = 200 - sample.response_length
    ctx = GenerateContext(server_manager=manager, tokenizer=tokenizer, config=None,
                          response_length=min(200, sample.response_length + 4))

    async def continue_it():
        try:
            return await generate(ctx, sample, params)
        finally:
            await manager.close()
    try:
        continued = asyncio.run(continue_it())
    finally:
        server.shutdown()
    assert budget > 4
    assert continued.status == "truncated" and continued.response_length == len(running.token_ids) + 4
    assert continued.response_ids[:len(running.token_ids)] == running.token_ids
    assert continued.token_versions == [0] * len(running.token_ids) + [1] * 4  # the version the server reported
    assert len(continued.rollout_log_probs) == continued.response_length
    assert PENDING != continued.status


# ---------------------------------------------------------------------- scoring and DAPO's keys on the group rollout

REWARD_HOOKS = '''
import asyncio

async def rank_in_group(config, group):
    await asyncio.sleep(0)
    return [{"rank": float(i), "len": len(sample.response_ids)} for i, sample in enumerate(group)]

def per_sample(config, sample):
    return float(sample.response_ids[-1])

def broken(config, sample):
    return {}["missing"]
'''


def test_reward_function_scores_samples_or_whole_groups_and_dapo_keys_pick_the_filter(tmp_path):
    from hybridrl.trainer.ppo.group_rollout import GroupRollout, HookFailed

    hooks = tmp_path / "rewards.py"
    hooks.write_text(REWARD_HOOKS)

    def rollout(*overrides):
        return GroupRollout(validate_config(flow_config(tmp_path, *overrides)), generator=None,
                            tokenizer=None, score_batch=None)

    def fresh():
        group = scored_group(5, [None, None, 0.5])
        group[1].response_ids = [4, 6]
        return group

    grouped = rollout(f"data_flow.reward_function.path={hooks}", "data_flow.reward_function.name=rank_in_group",
                      "data_flow.group_reward=true", "data_flow.reward_key=rank")
    group = grouped.score_group(fresh())
    assert [sample.reward_value() for sample in group] == [0.0, 1.0, 0.5]  # the scored one keeps its reward
    assert group[1].reward == {"rank": 1.0, "len": 2}
    single = rollout(f"data_flow.reward_function.path={hooks}", "data_flow.reward_function.name=per_sample")
    assert [sample.reward for sample in single.score_group(fresh())] == [9.0, 6.0, 0.5]
    failing = rollout(f"data_flow.reward_function.path={hooks}", "data_flow.reward_function.name=broken")
    with pytest.raises(HookFailed, match="(?s)data_flow.reward_function raised:.*in broken.*KeyError: 'missing'"):
        failing.score_group(fresh())

    dapo = rollout("data_flow.enable=false", "algorithm.filter_groups.enable=true",
                   "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=3")
    assert dapo.max_num_gen_batches == 3
    same_acc = scored_group(1, [0.0, 1.0])
    for sample in same_acc:
        sample.metadata["reward_extra_info"] = {"acc": 1.0}
    assert not dapo.keep(same_acc)  # rewards differ, but the group's acc does not: DAPO drops it
    same_acc[0].metadata["reward_extra_info"] = {"acc": 0.0}
    assert dapo.keep(same_acc)


def test_partial_rollout_takes_a_loop_that_can_resume_and_refuses_one_that_cannot(tmp_path):
    """tool_agent (can_resume) composes with the data flow, verl's filter_groups and partial rollout; a verl-style loop
    that does not declare can_resume is refused with partial rollout, with why, unless a custom generate function
    generates the samples."""
    tool_loop = ["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]
    config = validate_config(flow_config(tmp_path, *tool_loop, "algorithm.filter_groups.enable=true"))
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent"
    config = validate_config(flow_config(tmp_path, *tool_loop, "data_flow.partial_rollout=true"))
    assert config.data_flow.partial_rollout

    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: react_agent\n  _target_: verl_style_agent.ReactAgentLoop\n")
    verl_loop = [f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
                 "actor_rollout_ref.rollout.agent.default_agent_loop=react_agent"]
    assert not validate_config(flow_config(tmp_path, *verl_loop)).data_flow.partial_rollout
    with pytest.raises(ConfigError) as refused:
        validate_config(flow_config(tmp_path, *verl_loop, "data_flow.partial_rollout=true"))
    assert refused.value.problems == [
        "data_flow.partial_rollout: expected false with actor_rollout_ref.rollout.agent.default_agent_loop="
        "'react_agent' (the loop does not declare can_resume = True, so its aborted conversation cannot be continued: "
        "its groups are generated again; partial rollout continues the single-turn loop, tool_agent, a loop that "
        "declares AgentLoopBase.can_resume, or a data_flow.custom_generate_function that can), got True"]
    hooks = tmp_path / "hooks.py"
    hooks.write_text(HOOK_FILE)
    custom = [f"data_flow.custom_generate_function.path={hooks}", "data_flow.custom_generate_function.name=my_generate"]
    assert validate_config(flow_config(tmp_path, *verl_loop, *custom, "data_flow.partial_rollout=true")).data_flow \
        .partial_rollout


def test_an_agent_loop_run_becomes_the_sample_the_trainer_batches():
    """sample_from_loop: the loop's prompt, tokens, loss mask, versions (inserted tokens -1), reward, turns, metrics and
    extra_fields; a failed loop leaves one EOS with no loss and reward 0; an aborted run is marked aborted; reset
    clears what the loop set."""
    output = {"prompt_ids": [5, 6, 7], "response_ids": [10, 11, 40, 41, 12], "response_mask": [1, 1, 0, 0, 1],
              "response_logprobs": [-0.5, -0.25, 0.0, 0.0, -1.0], "reward_score": None, "num_turns": 4,
              "metrics": {"num_tool_calls": 1, "response_cut": 0}, "extra_fields": {"turn_scores": [0.5]}}
    result = {"output": output, "token_versions": [3, 3, -1, -1, 4], "aborted": False}
    sample = sample_from_loop(Sample(group_index=0, index=2, prompt_ids=[5], metadata={"data_source": "d"}), result,
                              eos_token_id=2, with_log_probs=True)
    assert (sample.prompt_ids, sample.response_ids, sample.loss_mask) == ([5, 6, 7], [10, 11, 40, 41, 12],
                                                                          [1, 1, 0, 0, 1])
    assert (sample.token_versions, sample.rollout_log_probs) == ([3, 3, -1, -1, 4], [-0.5, -0.25, 0.0, 0.0, -1.0])
    assert (sample.reward, sample.status, sample.num_turns, sample.error) == (None, COMPLETED, 4, None)
    assert sample.agent_metrics["num_tool_calls"] == 1
    # extra_fields and the turns become verl's batch columns (the scorer reads __num_turns__ as num_turns)
    assert sample.metadata == {"data_source": "d", "turn_scores": [0.5], "__num_turns__": 4}
    batch = groups_to_batch([[sample]], prompt_length=4, response_length=6, pad_token_id=0, with_log_probs=True,
                            scored=False)
    assert (batch.non_tensor_batch["__num_turns__"][0], batch.non_tensor_batch["turn_scores"][0]) == (4, [0.5])
    assert batch.batch["response_mask"][0].tolist() == [1, 1, 0, 0, 1, 0]
    assert batch.batch[WEIGHT_VERSIONS_KEY][0, :5].tolist() == [3, 3, -1, -1, 4]

    cut = sample_from_loop(Sample(group_index=0, index=3, prompt_ids=[5]), {
        "output": {**output, "reward_score": 1.0, "metrics": {"response_cut": 1}}, "token_versions": [3] * 5,
        "aborted": False}, eos_token_id=2, with_log_probs=False)
    assert (cut.status, cut.reward, cut.rollout_log_probs) == (TRUNCATED, 1.0, None)
    routed = sample_from_loop(Sample(group_index=0, index=6, prompt_ids=[5]), {
        "output": {**output, "routed_experts": [[0, 1]] * 5}, "token_versions": [3] * 5, "aborted": False},
        eos_token_id=2, with_log_probs=False)
    assert routed.metadata["routed_experts"] == [[0, 1]] * 5 and "routed_experts" not in cut.metadata
    aborted = sample_from_loop(Sample(group_index=0, index=4, prompt_ids=[5]), {**result, "aborted": True},
                               eos_token_id=2, with_log_probs=True)
    assert (aborted.status, aborted.num_aborts) == (ABORTED, 1)
    failed = sample_from_loop(Sample(group_index=0, index=5, prompt_ids=[5]), {"error": "Traceback ...: boom"},
                              eos_token_id=2, with_log_probs=True)
    assert (failed.response_ids, failed.loss_mask, failed.token_versions, failed.rollout_log_probs) == (
        [2], [0], [-1], [0.0])
    assert (failed.reward, failed.status, failed.error) == (0.0, COMPLETED, "Traceback ...: boom")
    [reset] = reset_group([sample])
    assert (reset.response_ids, reset.status, reset.num_turns, reset.agent_metrics, reset.error) == (
        [], PENDING, 0, None, None)


def test_the_data_flow_runs_on_a_rollout_pool_in_every_schedule_and_fully_async_streams_without_batches(tmp_path):
    """one_step_off and fully_async both run the data flow (partial rollout too); fully_async streams groups, so
    the keys that shape a batch of groups (over-sampling, a rollout function) are refused with it, naming why."""
    split = ["actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"]
    config = validate_config(flow_config(tmp_path, *split, "data_flow.partial_rollout=true"))
    assert (config.actor_rollout_ref.hybrid_engine, config.data_flow.partial_rollout) == (False, True)
    config = validate_config(flow_config(tmp_path, *split, "async_training.mode=one_step_off"))
    assert config.async_training.mode == "one_step_off"
    config = validate_config(flow_config(tmp_path, *split, "async_training.mode=fully_async",
                                         "data_flow.partial_rollout=true",
                                         "data_flow.dynamic_sampling_filter.name=check_reward_nonzero_std"))
    assert (config.async_training.mode, config.data_flow.partial_rollout) == ("fully_async", True)
    config = validate_config(flow_config(tmp_path, *split, "async_training.mode=fully_async", "data_flow.enable=false",
                                         "algorithm.filter_groups.enable=true"))
    assert config.algorithm.filter_groups.enable
    # the asynchronous schedules have the data flow as their one path: its keys act without data_flow.enable
    config = validate_config(flow_config(tmp_path, *split, "async_training.mode=one_step_off", "data_flow.enable=false",
                                         "data_flow.partial_rollout=true", "data_flow.buffer_filter.name=pop_first"))
    def flow_on(config):
        return data_flow_switch(config.data_flow.enable, config.algorithm.filter_groups.enable,
                                config.async_training.mode) is not None

    assert flow_on(config) and config.data_flow.partial_rollout and not config.data_flow.enable
    assert flow_on(validate_config(flow_config(tmp_path, *split, "async_training.mode=fully_async",
                                               "data_flow.enable=false")))
    assert not flow_on(validate_config(flow_config(tmp_path, *split, "data_flow.enable=false")))
    with pytest.raises(ConfigError) as refused:
        validate_config(flow_config(tmp_path, *split, "async_training.mode=fully_async",
                                    "data_flow.over_sampling_batch_size=24",
                                    "data_flow.over_sampling_filter.name=sort_by_reward_std"))
    why = ("with async_training.mode=fully_async (groups stream: each step takes the first data.train_batch_size kept "
           "groups to finish, (max_staleness + 1) x train_batch_size in flight)")
    assert refused.value.problems == [
        f"data_flow.over_sampling_batch_size: expected null {why}, got 24",
        f"data_flow.over_sampling_filter: expected null path and name {why}, got "
        f"{{'path': None, 'name': 'sort_by_reward_std'}}"]


def test_a_reward_model_scores_the_data_flow_in_every_schedule_but_not_for_a_filter_under_one_step_off(tmp_path):
    """A reward model scores the data flow's groups in every schedule; under one_step_off it scores each batch when
    its step takes it (its forward runs on the trainer ranks, which update while the next batch generates), so what
    needs the scores while generating is refused there, naming each key and why."""
    rm = ["reward_model.enable=true", f"reward_model.model.path={tmp_path}", "reward_model.micro_batch_size_per_gpu=2"]
    assert validate_config(flow_config(tmp_path, *rm)).reward_model.enable
    split = ["actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"]
    assert validate_config(flow_config(tmp_path, *rm, *split)).reward_model.enable
    assert validate_config(flow_config(tmp_path, *rm, *split, "async_training.mode=fully_async",
                                       "data_flow.dynamic_sampling_filter.name=check_reward_nonzero_std"))
    for overrides in ([], ["data_flow.enable=false"], ["data_flow.partial_rollout=true"],
                      ["data_flow.over_sampling_batch_size=12"]):  # partial rollout and stragglers need no score
        assert validate_config(flow_config(tmp_path, *rm, *split, "async_training.mode=one_step_off",
                                           *overrides)).reward_model.enable
    with pytest.raises(ConfigError) as refused:
        validate_config(flow_config(tmp_path, *rm, *split, "async_training.mode=one_step_off",
                                    "data_flow.dynamic_sampling_filter.name=check_reward_nonzero_std",
                                    "data_flow.over_sampling_batch_size=24",
                                    "data_flow.over_sampling_filter.name=sort_by_reward_std"))
    assert refused.value.problems == [
        "reward_model.enable: expected false with async_training.mode='one_step_off' and "
        "data_flow.dynamic_sampling_filter, data_flow.over_sampling_filter (data_flow.dynamic_sampling_filter judges "
        "each group by its score as it finishes; data_flow.over_sampling_filter orders the finished groups, by their "
        "scores, on the thread that generates ahead while the trainer pool's ranks update; the reward model runs on "
        "those ranks, so under one_step_off it scores a batch only when the step takes it, on the controller's main "
        "thread: use async_training.mode=fully_async or sync, or a data_flow.reward_function), got True"]
    with pytest.raises(ConfigError) as refused:
        validate_config(flow_config(tmp_path, *rm, *split, "async_training.mode=one_step_off", "data_flow.enable=false",
                                    "algorithm.filter_groups.enable=true"))
    expected = ("reward_model.enable: expected false with async_training.mode='one_step_off' and algorithm."
                "filter_groups.enable (algorithm.filter_groups.enable judges each group by its score as it finishes, "
                "on the thread")
    assert [problem[:len(expected)] for problem in refused.value.problems] == [expected]


def test_the_data_flow_logs_agent_loop_metrics_of_the_samples_a_loop_made():
    """agent_loop/* over the trained samples a loop generated (a failed loop counts with empty metrics, as in the async
    rollout), num_failed over the whole step; nothing for samples no loop made (the single-turn path)."""
    from hybridrl.trainer.ppo.group_rollout import _agent_loop_metrics

    def sample(index, **fields):
        return Sample(group_index=0, index=index, prompt_ids=[1], **fields)

    single_turn = [sample(0), sample(1)]
    assert _agent_loop_metrics([single_turn], failed=0) == {}
    tool = sample(2, num_turns=4, agent_metrics={"num_tool_calls": 2, "tool_latency_s": 0.5})
    failed = sample(3, error="Traceback ...: boom")
    metrics = _agent_loop_metrics([[tool, failed]], failed=3)
    assert metrics["agent_loop/num_failed"] == 3  # the step's, dropped groups included
    assert (metrics["num_turns/mean"], metrics["num_turns/min"]) == (2.0, 0.0)
    assert metrics["agent_loop/num_tool_calls/mean"] == 1.0 and metrics["agent_loop/used_tools/mean"] == 0.5
    assert metrics["agent_loop/tool_latency_s/mean"] == 0.25  # 0.5 s over 2 calls


# ---------------------------------------------------------------------- ReMax's baseline as a sample of its group

def with_scored_baseline(group, reward):
    """`group` with a scored greedy baseline last, as the data flow generates it for ReMax."""
    first = group[0]
    return [*group, Sample(group_index=first.group_index, index=first.index + len(group), prompt_ids=first.prompt_ids,
                           response_ids=[7], loss_mask=[1], token_versions=[0], reward=reward, status="completed",
                           metadata=dict(first.metadata), is_baseline=True)]


def test_groups_to_batch_trains_the_sampled_responses_and_gives_each_row_its_groups_baseline_score():
    groups = [with_scored_baseline(scored_group(3, [1.0, 0.0]), 0.25),
              with_scored_baseline(scored_group(4, [0.5, 0.75]), 2.0)]
    batch = groups_to_batch(groups, prompt_length=4, response_length=5, pad_token_id=0, with_log_probs=False,
                            scored=True)
    assert len(batch) == 4  # 2 groups x rollout.n: the baselines are no rows
    assert batch.batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, 0.5, 0.75]
    assert batch.batch["reward_baselines"].tolist() == [0.25, 0.25, 2.0, 2.0]
    assert batch.non_tensor_batch["uid"].tolist() == ["3", "3", "4", "4"]
    unscored = groups_to_batch(groups, prompt_length=4, response_length=5, pad_token_id=0, with_log_probs=False,
                               scored=False)
    assert len(unscored) == 4 and "reward_baselines" not in unscored.batch
    assert "reward_baselines" not in groups_to_batch([scored_group(5, [1.0])], prompt_length=4, response_length=5,
                                                     pad_token_id=0, with_log_probs=False, scored=True).batch
    with pytest.raises(ValueError, match=r"groups \[5\] have no baseline"):
        groups_to_batch([groups[0], scored_group(5, [1.0, 0.0])], prompt_length=4, response_length=5,
                        pad_token_id=0, with_log_probs=False, scored=True)


def test_the_prompt_source_makes_each_remax_group_with_its_baseline_and_keeps_it_through_a_checkpoint():
    source = PromptSource(dataset_batches(), n=2, config=None, baseline=True)
    first = source.get_groups(2, step=1)
    assert [[sample.is_baseline for sample in group] for group in first] == [[False, False, True]] * 2
    assert [sample.index for group in first for sample in group] == [0, 1, 2, 3, 4, 5]
    assert first[1][2].prompt_ids == [1, 2] and first[1][2].metadata == first[1][0].metadata
    first[1][2].append([9], None, version=0)
    first[1][2].status = ABORTED  # an aborted baseline waits in the buffer with its group, its tokens kept
    source.add_groups([first[1]])
    with pytest.raises(ValueError, match="2 samples .rollout.n. and its baseline last"):
        source.add_groups([first[0][:2]])
    resumed = PromptSource(dataset_batches(), n=2, config=None, baseline=True)
    resumed.load_state_dict(torch.load(_saved(source.state_dict()), weights_only=True))
    [again] = resumed.get_groups(1, step=2)
    assert again[2].is_baseline and (again[2].response_ids, again[2].status) == ([9], ABORTED)

    # a buffer saved by a run without the baseline gets a pending one; one with baselines resumed without ReMax
    # loses them
    plain = PromptSource(dataset_batches(), n=2, config=None)
    plain.add_groups([scored_group(7, [1.0, 0.0])])
    remax = PromptSource(dataset_batches(), n=2, config=None, baseline=True)
    remax.load_state_dict(torch.load(_saved(plain.state_dict()), weights_only=True))
    [added] = remax.get_groups(1, step=1)
    assert [s.is_baseline for s in added] == [False, False, True] and added[2].status == PENDING
    assert (added[2].group_index, added[2].prompt_ids, added[2].reward) == (7, [1, 2], None)
    assert added[2].index == 0 and remax.next_sample_index == 1  # a new sample index, not one of another group's
    plain.load_state_dict(torch.load(_saved(source.state_dict()), weights_only=True))
    [stripped] = plain.get_groups(1, step=2)
    assert [s.is_baseline for s in stripped] == [False, False]

    seen = []

    def last_first(config, step, buffer, num_groups):
        seen.append([len(group) for group in buffer])
        return list(reversed(buffer))[:num_groups]

    filtered = PromptSource(dataset_batches(), n=2, config=None, baseline=True, buffer_filter=last_first)
    filtered.add_groups([with_scored_baseline(scored_group(i, [1.0, 0.0]), 0.5) for i in range(3)])
    taken = filtered.get_groups(2, step=1)
    assert seen == [[2, 2, 2]]  # the buffer filter judges the sampled responses
    assert [(group[0].group_index, len(group), group[2].is_baseline) for group in taken] == [(2, 3, True),
                                                                                             (1, 3, True)]


def test_the_group_rollout_judges_and_counts_only_the_sampled_responses_and_sets_reward_baselines(tmp_path):
    from types import SimpleNamespace

    from hybridrl.trainer.ppo.group_rollout import GroupRollout, _order

    hooks = tmp_path / "rewards.py"
    hooks.write_text(REWARD_HOOKS)
    remax = ["algorithm.adv_estimator=remax", "actor_rollout_ref.rollout.n=2"]
    rollout = GroupRollout(validate_config(flow_config(tmp_path, *remax, f"data_flow.reward_function.path={hooks}",
                                                       "data_flow.reward_function.name=per_sample",
                                                       "data_flow.dynamic_sampling_filter.name=check_reward_nonzero_std")),
                           generator=None, tokenizer=SimpleNamespace(pad_token_id=0), score_batch=None)
    assert rollout.with_baseline
    group = with_scored_baseline(scored_group(1, [None, None]), None)
    group[2].response_ids = [3]  # per_sample scores the last token: sampled 9, 9; baseline 3
    rollout.start_counting(1)
    rollout.score_group(group)
    assert [sample.reward for sample in group] == [9.0, 9.0, 3.0]  # the baseline is scored with its group
    assert rollout.counts.scored == [9.0, 9.0] and rollout.counts.generated == 3
    assert not rollout.keep(group)  # the sampled rewards are equal: dropped, whatever the baseline scored
    group[1].reward = 1.0
    assert rollout.keep(group)
    ordered = _order(rollout, filters.sort_by_reward_std, [with_scored_baseline(scored_group(0, [1.0, 1.0]), 9.0),
                                                           group])
    assert [g[0].group_index for g in ordered] == [1, 0] and all(g[-1].is_baseline for g in ordered)
    batch, metrics = rollout.to_batch([group], weights_version=0)
    assert batch.batch["reward_baselines"].tolist() == [3.0, 3.0] and len(batch) == 2
    assert metrics["data_flow/baseline_reward/mean"] == 3.0
    with pytest.raises(ValueError, match="data_flow.rollout_function: group 0 has no ReMax baseline"):
        rollout._check_groups([scored_group(1, [1.0, 0.0])], "data_flow.rollout_function", 2, baseline=True)
    assert rollout._check_groups([group], "data_flow.rollout_function", 2, baseline=True) == [group]
