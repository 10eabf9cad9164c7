"""Agent loops without a trainer: the registry and its YAML, the engine server (real HTTP on 127.0.0.1) with the
batching HF engine on a tiny real model, the server manager's balancing, and the loop reward's placement."""
import asyncio
import textwrap
import time

import pytest
import torch

from hybridrl.agent_loop.base import load_agent_loop_config
from hybridrl.agent_loop.manager import agent_loop_metrics, check_agent_names, check_output
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager, EngineServerError
from hybridrl.agent_loop import AgentLoopOutput
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.workers.rollout.async_server import EngineServer, HFGenerateEngine
from hybridrl.data.sample import Sample, samples_to_batch


# ---------------------------------------------------------------------- registry


def test_yaml_loops_join_the_builtin_ones(tmp_path, monkeypatch):
    (tmp_path / "my_loops.py").write_text(textwrap.dedent('''
        from hybridrl.agent_loop import AgentLoopBase
        class Echo(AgentLoopBase):
            async def run(self, sampling_params, **kwargs):
                raise NotImplementedError
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "loops.yaml"
    path.write_text("- name: echo\n  _target_: my_loops.Echo\n  greeting: hi\n")
    registry = load_agent_loop_config(str(path))
    assert registry["echo"] == {"_target_": "my_loops.Echo", "greeting": "hi"}
    assert "single_turn_agent" in registry
    with pytest.raises(ValueError, match=r"\['nope'\] are not registered; known: \[.*'echo'.*'single_turn_agent'"):
        check_agent_names(["echo", "nope"], registry, "dataset column agent_name")


@pytest.mark.parametrize("text, message", [
    ("name: x\n", "expected a YAML list"),
    ("- name: x\n", "entry 0: expected a mapping with string keys name and _target_"),
    ("- name: x\n  _target_: no_such_module.Loop\n", "entry 0 \\('x'\\): cannot import _target_"),
    ("- name: x\n  _target_: collections.OrderedDict\n", "must be a subclass of hybridrl.agent_loop.AgentLoopBase"),
])
def test_bad_agent_loop_yaml_names_the_entry(tmp_path, text, message):
    path = tmp_path / "loops.yaml"
    path.write_text(text)
    with pytest.raises((ValueError, ImportError, TypeError), match=message):
        load_agent_loop_config(str(path))


def test_outputs_that_do_not_fit_are_the_loops_fault():
    class Rollout:
        prompt_length, response_length, calculate_log_probs = 4, 3, False
    good = dict(prompt_ids=[1, 2], response_ids=[3, 4], response_mask=[1, 0])
    check_output(AgentLoopOutput(**good), Rollout, "x")
    for bad, message in ((dict(good, response_mask=[1]), "response_mask has 1 entries"),
                         (dict(good, response_ids=[3, 4, 5, 6], response_mask=[1] * 4), "more than rollout"),
                         (dict(good, prompt_ids=[1] * 5), "prompt_ids has 5 tokens"),
                         (dict(good, response_mask=[1, 2]), "only 0 and 1")):
        with pytest.raises(ValueError, match=message):
            check_output(AgentLoopOutput(**bad), Rollout, "x")
    check_output(AgentLoopOutput(**good, multi_modal_data={}), Rollout, "x")  # what verl's loops give for text
    with pytest.raises(ValueError, match=r"multi_modal_data is set \(\['images'\]\), but the models here are "
                                         r"text-only"):
        check_output(AgentLoopOutput(**good, multi_modal_data={"images": [object()]}), Rollout, "x")
    Rollout.calculate_log_probs = True
    with pytest.raises(ValueError, match="calculate_log_probs is on but the loop returned no response_logprobs"):
        check_output(AgentLoopOutput(**good), Rollout, "x")


def test_every_verl_metric_reaches_the_metrics():
    """verl's metrics (a dict, as verl's loops pass them) become verl's timing_s/agent_loop/* and a loop's own numeric
    ones agent_loop/<name>/mean; num_preempted -1 (unknown) stays out of its mean. (extra_fields, __num_turns__ and
    routed_experts become batch columns through the sample: test_data_flow.)"""
    base = dict(prompt_ids=[1], response_ids=[2, 3], response_mask=[1, 1], num_turns=2)
    outputs = [AgentLoopOutput(**base, routed_experts=[[0, 1]] * 3, extra_fields={"turn_scores": [1.0]},
                               metrics={"generate_sequences": 0.5, "num_preempted": 2, "compute_score": 0.25,
                                        "queue_s": 3.0, "note": "not a number"}),
               AgentLoopOutput(**base, metrics={"generate_sequences": 1.5, "num_preempted": -1})]
    metrics = agent_loop_metrics([output.num_turns for output in outputs], [output.metrics for output in outputs],
                                 [(1, 2), (1, 2)])
    assert (metrics["timing_s/agent_loop/generate_sequences/mean"], metrics["agent_loop/num_preempted/mean"],
            metrics["timing_s/agent_loop/compute_score/mean"], metrics["agent_loop/queue_s/mean"]) == (1.0, 2.0, 0.125, 3.0)
    assert "agent_loop/note/mean" not in metrics


# ---------------------------------------------------------------------- the loop's reward


def test_verls_timing_metrics_and_the_slowest_sample_by_hand():
    """timing_s/agent_loop/{generate_sequences,tool_calls,compute_score}/{min,max,mean} per sample and slowest/*: the
    sample with the most seconds of the three (here the second: 1.0 + 2.0 + 0.5 = 3.5 against 3.1 and 0.2), verl's
    num_turns/*."""
    from hybridrl.agent_loop.base import AgentLoopMetrics

    metrics = [AgentLoopMetrics(generate_sequences=3.0, tool_calls=0.0, compute_score=0.1, num_preempted=0),
               AgentLoopMetrics(generate_sequences=1.0, tool_calls=2.0, compute_score=0.5, num_preempted=3),
               AgentLoopMetrics(generate_sequences=0.2, num_preempted=-1)]
    got = agent_loop_metrics([2, 6, 2], metrics, [(10, 40), (12, 300), (9, 5)])
    assert (got["num_turns/min"], got["num_turns/max"], got["num_turns/mean"]) == (2.0, 6.0, pytest.approx(10 / 3))
    assert (got["timing_s/agent_loop/generate_sequences/min"], got["timing_s/agent_loop/generate_sequences/max"],
            got["timing_s/agent_loop/generate_sequences/mean"]) == (0.2, 3.0, pytest.approx(4.2 / 3))
    assert (got["timing_s/agent_loop/tool_calls/max"], got["timing_s/agent_loop/tool_calls/mean"]) == (
        2.0, pytest.approx(2 / 3))
    slowest = {key.rsplit("/", 1)[1]: value for key, value in got.items() if "/slowest/" in key}
    assert slowest == {"generate_sequences": 1.0, "tool_calls": 2.0, "compute_score": 0.5, "num_preempted": 3.0,
                       "prompt_length": 12.0, "response_length": 300.0}
    assert got["agent_loop/num_preempted/mean"] == 1.5  # -1 (unknown) left out


def test_a_score_on_a_trailing_tool_span_goes_on_the_last_model_token_and_is_not_lost():
    from hybridrl.algorithms.core_algos import (compute_gae_advantage_return,
                                                 compute_reinforce_plus_plus_outcome_advantage)

    # row 0: model, model, tool, tool; row 1: no holes; row 2: a failed loop (nothing trained): its last token
    samples = [Sample(group_index=0, index=row, prompt_ids=[5], response_ids=[6] * len(mask), loss_mask=mask,
                      token_versions=[0] * len(mask), reward=reward)
               for row, (mask, reward) in enumerate([([1, 1, 0, 0], 1.0), ([1, 1, 1], 0.5), ([0], 0.0)])]
    batch = samples_to_batch(samples, prompt_length=1, response_length=4, pad_token_id=0, with_log_probs=False,
                             scored=True)
    moved, response_mask = batch.batch["token_level_scores"], batch.batch["response_mask"]
    assert moved.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])  # the last real token
    # where the score sat, the estimators (which skip masked tokens) lost it; moved, row 0 earns it
    _, lost = compute_reinforce_plus_plus_outcome_advantage(scores, response_mask, gamma=1.0)
    _, kept = compute_reinforce_plus_plus_outcome_advantage(moved, response_mask, gamma=1.0)
    assert lost[0].abs().sum() == 0 and kept[0, :2].tolist() == [1.0, 1.0]
    _, gae_returns = compute_gae_advantage_return(moved, torch.zeros(3, 4), response_mask, gamma=1.0, lam=1.0)
    assert gae_returns[0, :2].tolist() == [1.0, 1.0]


# ---------------------------------------------------------------------- engine servers


class SlowEcho:
    """An engine that answers its prompt's last token after `delay` seconds: makes in-flight counts visible."""

    def __init__(self, delay=0.2, fail=False):
        self.delay, self.fail, self.seen = delay, fail, 0

    async def generate(self, prompt_ids, sampling_params):
        self.seen += 1
        await asyncio.sleep(self.delay)
        if self.fail:
            raise ValueError("the engine broke on purpose")
        return {"token_ids": [prompt_ids[-1]], "log_probs": None, "stop_reason": "completed"}


def served(engine):
    server = EngineServer(engine, "127.0.0.1")
    server.serve()
    return server


def test_least_in_flight_balancing_and_sticky_request_ids():
    engines = [SlowEcho(), SlowEcho()]
    servers = [served(engine) for engine in engines]
    manager = AsyncLLMServerManager([server.address for server in servers])

    async def scenario():
        first = [manager.generate(f"r{i}", prompt_ids=[i], sampling_params={}) for i in range(6)]
        outputs = await asyncio.gather(*first)
        # a second turn of r0..r5 goes where each first went, whatever the load now is
        where = {f"r{i}": manager.choose_server(f"r{i}") for i in range(6)}
        await manager.close()
        return outputs, where

    try:
        outputs, where = asyncio.run(scenario())
    finally:
        for server in servers:
            server.shutdown()
    assert [output.token_ids for output in outputs] == [[i] for i in range(6)]
    assert [engine.seen for engine in engines] == [3, 3]  # 6 concurrent requests: least-in-flight alternates
    assert sorted(where.values()) == sorted([servers[0].address] * 3 + [servers[1].address] * 3)
    assert manager.choose_server("r0") == where["r0"]


def test_the_server_reports_its_window_requests_and_when_the_first_and_last_came():
    """pause() returns what the serving window saw: 3 requests; the last admitted at least the client's 0.3 s pause
    after the first (a lower bound the clock cannot break); a window without requests reports 0 of them."""
    server = served(SlowEcho(delay=0))
    manager = AsyncLLMServerManager([server.address])

    async def scenario():
        await asyncio.gather(*(manager.generate(f"r{i}", prompt_ids=[i], sampling_params={}) for i in range(2)))
        await asyncio.sleep(0.3)
        await manager.generate("late", prompt_ids=[9], sampling_params={})
        await manager.close()

    try:
        asyncio.run(scenario())
        window = server.pause()
        server.serve()
        empty = server.pause()
    finally:
        server.shutdown()
    assert window["rollout/server_requests"] == 3
    assert 0 <= window["timing_s/server_first_request"]
    assert window["timing_s/server_last_request"] - window["timing_s/server_first_request"] >= 0.3
    assert empty == {"rollout/server_requests": 0.0}
    assert server.pause() == {}  # not serving: no window


class Gate:
    """An engine that answers nobody until `expected` requests are inside it at once, or `patience` seconds passed
    (so that a client which holds requests back fails the test instead of hanging it)."""

    def __init__(self, expected, patience=60.0):
        self.expected, self.patience, self.inside, self.most_inside, self.all_in = expected, patience, 0, 0, None

    async def generate(self, prompt_ids, sampling_params):
        if self.all_in is None:
            self.all_in = asyncio.Event()  # on the server's loop
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        if self.inside == self.expected:
            self.all_in.set()
        try:
            await asyncio.wait_for(self.all_in.wait(), timeout=self.patience)
        except asyncio.TimeoutError:
            self.all_in.set()  # the rest are not coming: answer everyone
        self.inside -= 1
        return {"token_ids": [prompt_ids[-1]], "log_probs": None, "stop_reason": "completed"}


def test_every_request_in_flight_reaches_the_server_at_once():
    """150 concurrent requests from one manager are all at the engine together: the client caps nothing (aiohttp's
    default connector held all but 100 back, so the gate waited for 150 in vain)."""
    gate = Gate(expected=150)
    server = served(gate)
    manager = AsyncLLMServerManager([server.address])

    async def scenario():
        requests = [manager.generate(f"r{i}", prompt_ids=[i], sampling_params={}) for i in range(150)]
        try:
            return await asyncio.gather(*requests)
        finally:
            await manager.close()

    try:
        outputs = asyncio.run(scenario())
    finally:
        server.shutdown()
    assert gate.most_inside == 150
    assert [output.token_ids for output in outputs] == [[i] for i in range(150)]


def test_engine_error_and_dead_server_are_engine_server_errors():
    """A dead server fails the request at once: its refused connection is the error, not a connect timeout
    (connect_timeout_s, 30 s); shown by the cause, which no load can change, rather than by a time."""
    import aiohttp

    broken = served(SlowEcho(delay=0, fail=True))
    dead = served(SlowEcho())
    dead_address = dead.address
    dead.shutdown()

    async def call(address):
        manager = AsyncLLMServerManager([address])
        try:
            return await manager.generate("r", prompt_ids=[1], sampling_params={})
        finally:
            await manager.close()

    try:
        with pytest.raises(EngineServerError, match="(?s)HTTP 500.*the engine broke on purpose"):
            asyncio.run(call(broken.address))
        with pytest.raises(EngineServerError, match="unreachable or died mid-request: ClientConnectorError") as dead:
            asyncio.run(call(dead_address))
        cause = dead.value.__cause__
        assert isinstance(cause, aiohttp.ClientConnectorError) and isinstance(cause.os_error, ConnectionRefusedError)
    finally:
        broken.shutdown()


class Exact:
    """An engine whose answer has floats that a lossy codec would change (the shortest repr round-trips them)."""
    log_probs = [-0.1, -1e-300, -12.345678901234567, -0.0, -2.5e-8]

    async def generate(self, prompt_ids, sampling_params):
        return {"token_ids": [151_935, 0, *prompt_ids], "log_probs": self.log_probs, "stop_reason": "length"}


def test_answers_cross_the_wire_exactly_and_a_body_that_is_not_json_is_refused_by_name():
    """The server's msgspec JSON and the client's: every token id and log-prob arrives bit for bit; a request body
    that is not JSON answers HTTP 400 naming the server, before any engine work."""
    import aiohttp

    server = served(Exact())
    manager = AsyncLLMServerManager([server.address])

    async def scenario():
        answer = await manager.generate("r", prompt_ids=[7, 8], sampling_params={"logprobs": True})
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{server.address}/generate", data=b"{not json") as response:
                refused = response.status, await response.text()
        await manager.close()
        return answer, refused

    try:
        answer, (status, text) = asyncio.run(scenario())
    finally:
        server.shutdown()
    assert answer.token_ids == [151_935, 0, 7, 8] and answer.stop_reason == "length"
    assert [value.hex() for value in answer.log_probs] == [value.hex() for value in Exact.log_probs]
    assert status == 400 and f"engine server {server.address}: the request is not JSON" in text


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = build_tokenizer(["a b c d e f g h i j say something about apple banana"] * 20, vocab_size=120)
    model_dir = build_tiny_model(str(root / "model"), tokenizer, hidden_size=32, num_layers=2, num_heads=2,
                                 num_kv_heads=1, intermediate_size=64)
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), tokenizer


def test_hf_engine_batches_concurrent_requests_and_matches_generate(tiny_model):
    model, tokenizer = tiny_model
    engine = HFGenerateEngine(model, response_length=6, eos_token_ids=[tokenizer.eos_token_id],
                              pad_token_id=tokenizer.pad_token_id, max_batch_size=64)
    server = served(engine)
    manager = AsyncLLMServerManager([server.address])
    prompts = [tokenizer("say something about apple")["input_ids"], tokenizer("a b c")["input_ids"],
               tokenizer("banana")["input_ids"]]
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    async def scenario():
        outputs = await asyncio.gather(*(manager.generate(f"r{i}", prompt_ids=prompt, sampling_params=greedy)
                                         for i, prompt in enumerate(prompts)))
        short = await manager.generate("s", prompt_ids=prompts[0], sampling_params={**greedy, "max_tokens": 2})
        await manager.close()
        return outputs, short

    try:
        outputs, short = asyncio.run(scenario())
    finally:
        server.shutdown()
    assert engine.batch_sizes == [3, 1]  # the three concurrent requests ran as one generate call
    for prompt, output in zip(prompts, outputs):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               output_logits=True, return_dict_in_generate=True)
        expected = alone.sequences[0, len(prompt):].tolist()
        if tokenizer.eos_token_id in expected:
            expected = expected[:expected.index(tokenizer.eos_token_id) + 1]
        assert output.token_ids == expected
        logits = torch.stack(alone.logits, dim=1)[0, :len(expected)].float()
        expected_logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(expected)[:, None]).squeeze(-1)
        assert output.log_probs == pytest.approx(expected_logprobs.tolist(), abs=1e-4)
    assert short.token_ids == outputs[0].token_ids[:2]


class CountingGate(asyncio.Event):
    """EngineServer's rollout-mode gate (its `_open` event), counting the requests that reached it."""

    def __init__(self):
        super().__init__()
        self.reached = 0

    async def wait(self):
        self.reached += 1
        return await super().wait()


def test_a_request_in_trainer_mode_waits_for_the_next_rollout_mode():
    """SGLang's server shares the engine's loop, which the worker also runs in trainer mode (release, resume): a
    request accepted then must wait at the gate, not reach the released engine. The test drives the loop until
    the request is at the gate (counted there), not for a fixed time that a loaded machine could make too short."""
    import threading

    engine = SlowEcho(delay=0)
    server = served(engine)
    server.pause()  # trainer mode
    gate = server._open = CountingGate()  # closed, as pause() left the gate
    answers = {}

    def client():
        async def ask():
            manager = AsyncLLMServerManager([server.address])
            try:
                return await manager.generate("w", prompt_ids=[5], sampling_params={})
            finally:
                await manager.close()
        answers["w"] = asyncio.run(ask())

    thread = threading.Thread(target=client)
    async def until_the_request_is_at_the_gate():  # the worker driving the loop in trainer mode
        deadline = time.monotonic() + 120  # only a broken server waits this long
        while not gate.reached:
            assert time.monotonic() < deadline, "the request never reached the server's gate"
            await asyncio.sleep(0.01)

    thread.start()
    try:
        server.loop.run_until_complete(until_the_request_is_at_the_gate())
        assert engine.seen == 0 and "w" not in answers
        server.serve()  # rollout mode
        thread.join(timeout=120)
        assert not thread.is_alive(), "the request was not answered once the server served again"
        assert answers["w"].token_ids == [5] and engine.seen == 1
    finally:
        server.shutdown()
