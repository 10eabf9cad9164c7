"""Partial rollout of tool_agent (data_flow.partial_rollout with a multi-turn loop): a conversation an abort interrupts
is continued where it stopped. Real parts: the HF engine behind a real EngineServer on 127.0.0.1, a tiny real model
taught one tool conversation (so greedy decoding calls the calculator and answers), the real calculator tool, and
the agent-loop worker's own path (AgentLoopWorker._generate_sample, run in-process, no Ray) that turns each run into
the data flow's Sample. The abort lands at an exact token: a forward hook holds the generation while it comes."""
from __future__ import annotations

import asyncio
import contextlib
import os

import pytest
import torch

from hybridrl.agent_loop.manager import AgentLoopWorker
from hybridrl.agent_loop.sample_generate import GenerateContext
from hybridrl.agent_loop.server_manager import abort_servers
from hybridrl.agent_loop.tool_agent import ToolAgentLoop
from hybridrl.config import compose_config, validate_config
from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY
from hybridrl.data.sample import ABORTED, COMPLETED, Sample, groups_to_batch
from hybridrl.defaults.tiny_model import build_tiny_model, build_tokenizer
from hybridrl.defaults.tool_chat_template import TOOL_CHAT_TEMPLATE
from hybridrl.workers.rollout.async_server import EngineServer, HFGenerateEngine
from test_data_flow import HoldAtForward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALCULATOR_YAML = os.path.join(REPO, "examples/sglang_multiturn/config/tool_config/calculator_tool_config.yaml")
QUESTION = [{"role": "user", "content": "What is 12*34?"}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
ANSWER = "The answer is 408."
RESPONSE_LENGTH = 200
PARAMS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def run_config(tool_config_path: str = CALCULATOR_YAML):
    return validate_config(compose_config([
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true", "actor_rollout_ref.actor.strategy=fsdp2",
        "trainer.device=cpu", "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config_path}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"data.max_response_length={RESPONSE_LENGTH}", "data_flow.enable=true", "data_flow.partial_rollout=true"]))


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """(config, tokenizer, model, hold, conversation ids): a tiny model that learnt the whole tool conversation (the
    prompt with the calculator's schema, the call, the tool's answer, the final answer) by heart, so greedy decoding
    from any prefix of it goes on with the rest."""
    from transformers import AutoModelForCausalLM

    texts = [CALL, "<tool_response> user assistant system Tools: calculator answer Error",
             "What is 12*34? " + ANSWER] * 20
    tokenizer = build_tokenizer(texts, vocab_size=400)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    config = run_config()
    ToolAgentLoop._class_initialized = False  # the class's tools from this config
    ToolAgentLoop.init_class(config, tokenizer)
    messages = QUESTION + [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "408"},
                           {"role": "assistant", "content": ANSWER}]
    text = tokenizer.apply_chat_template(messages, tools=ToolAgentLoop.tool_schemas, tokenize=False).removesuffix("\n")
    conversation = tokenizer(text, add_special_tokens=False)["input_ids"]
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), tokenizer, hidden_size=64,
                                 num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor([conversation])
    for _ in range(300):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    hold = HoldAtForward()
    model.register_forward_hook(hold)
    return config, tokenizer, model, hold, conversation


@contextlib.contextmanager
def serving(model, tokenizer, version: int):
    """An HF engine server on 127.0.0.1 serving `model` as weights `version`, shut down on leaving."""
    engine = HFGenerateEngine(model, response_length=RESPONSE_LENGTH, eos_token_ids=[tokenizer.eos_token_id],
                              pad_token_id=tokenizer.pad_token_id, max_batch_size=1)
    server = EngineServer(engine, "127.0.0.1")
    server.serve(weight_version=version)
    try:
        yield server
    finally:
        server.shutdown()


def worker_for(config, tokenizer, server: EngineServer):
    """The agent-loop worker's sample path in this process (the Ray actor's class, not started as an actor); tool_agent
    builds its tools from `config` (a class-level set-up, redone for each test's tool)."""
    ToolAgentLoop._class_initialized = False
    return AgentLoopWorker.__ray_actor_class__(config, tokenizer, [server.address])


def generate_sample(config, tokenizer, server: EngineServer, sample: Sample, while_generating=None) -> Sample:
    """One AgentLoopWorker._generate_sample call against `server`; `while_generating` runs in a thread meanwhile."""
    worker = worker_for(config, tokenizer, server)
    ctx = GenerateContext(server_manager=worker.server_manager, tokenizer=tokenizer, config=config,
                          response_length=RESPONSE_LENGTH)

    async def go():
        try:
            task = asyncio.create_task(worker._generate_sample(ctx, sample, dict(PARAMS)))
            if while_generating is not None:
                await asyncio.to_thread(while_generating)
            return await task
        finally:
            await worker.server_manager.close()
    return asyncio.run(go())


HELD_AT = 6  # the abort comes while the 6th token of the first assistant turn (inside the tool call's JSON) is made


def test_an_aborted_tool_conversation_continues_mid_turn_and_its_tool_call_runs_once(taught, tmp_path):
    """The first assistant turn is aborted after HELD_AT tokens of its tool call (weights version 0); continued
    under version 1 it finishes that turn, parses the call from the whole turn, runs the calculator once and
    answers. Tokens, mask, log-probs and versions are the ones worked out by hand from the conversation."""
    config, tokenizer, model, hold, conversation = taught
    prompt_ids = tokenizer(tokenizer.apply_chat_template(QUESTION, tools=ToolAgentLoop.tool_schemas, tokenize=False,
                                                         add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    first = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]
    second = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [eos]
    assert conversation[:len(prompt_ids) + len(first)] == prompt_ids + first
    inserted = len(conversation) - len(prompt_ids) - len(first) - len(second)
    assert conversation[len(conversation) - len(second):] == second and inserted > 0 and len(first) > HELD_AT

    sample = Sample(group_index=0, index=0, prompt_ids=[1, 2, 3], metadata={"raw_prompt": QUESTION,
                                                                            "tools_kwargs": {}})
    with serving(model, tokenizer, version=0) as server:
        def abort_at_the_held_token():
            hold.arm(HELD_AT)
            assert hold.held.wait(120), "the first turn never reached its held forward"
            abort_servers([server.address])
            hold.release.set()
        try:
            aborted = generate_sample(config, tokenizer, server, sample, while_generating=abort_at_the_held_token)
        finally:
            hold.release.set()
    assert (aborted.status, aborted.num_aborts) == (ABORTED, 1)
    assert aborted.prompt_ids == prompt_ids  # the loop's own prompt: its chat template and tool schemas
    assert aborted.response_ids == first[:HELD_AT] and aborted.loss_mask == [1] * HELD_AT
    assert aborted.token_versions == [0] * HELD_AT and len(aborted.rollout_log_probs) == HELD_AT
    assert aborted.agent_metrics["num_tool_calls"] == 0 and aborted.num_turns == 1  # nothing parsed yet
    assert aborted.resume_state["turn_start"] == 0
    before_log_probs = list(aborted.rollout_log_probs)
    torch.save(aborted.to_dict(), tmp_path / "buffer.pt")  # a checkpoint of the buffer holds it as plain values
    aborted = Sample.from_dict(torch.load(tmp_path / "buffer.pt", weights_only=True))

    with serving(model, tokenizer, version=1) as server:  # the next step's weights (the same values here)
        done = generate_sample(config, tokenizer, server, aborted)
    assert (done.status, done.num_aborts, done.error, done.resume_state) == (COMPLETED, 1, None, None)
    assert done.prompt_ids + done.response_ids == conversation
    assert done.loss_mask == [1] * len(first) + [0] * inserted + [1] * len(second)
    assert done.token_versions == [0] * HELD_AT + [1] * (len(first) - HELD_AT) + [-1] * inserted + [1] * len(second)
    assert done.rollout_log_probs[:HELD_AT] == before_log_probs
    assert done.rollout_log_probs[len(first):len(first) + inserted] == [0.0] * inserted
    assert all(value < 0 for value in done.rollout_log_probs[HELD_AT:len(first)])
    # the call, cut by the abort, was read from the whole turn and ran exactly once: one call, one tool message
    assert (done.agent_metrics["num_tool_calls"], done.agent_metrics["num_tool_errors"]) == (1, 0)
    assert done.metadata["tool_rewards"] == [0.0] and done.num_turns == 4
    assert tokenizer.decode(conversation[len(prompt_ids) + len(first):len(conversation) - len(second)]).count(
        "<tool_response>") == 1
    assert done.agent_metrics["tokenization_mismatch"] == 0

    stale_masked = groups_to_batch([[done]], prompt_length=len(prompt_ids), response_length=RESPONSE_LENGTH,
                                   pad_token_id=tokenizer.pad_token_id, with_log_probs=True, scored=False,
                                   current_version=1, mask_stale_tokens=True)
    width = len(done.response_ids)
    assert stale_masked.batch["response_mask"][0, :width].tolist() == \
        [0] * HELD_AT + [1] * (len(first) - HELD_AT) + [0] * inserted + [1] * len(second)
    assert stale_masked.batch[WEIGHT_VERSIONS_KEY][0, :width].tolist() == done.token_versions


ABORTING_TOOL = '''
from hybridrl.agent_loop.server_manager import abort_servers
from hybridrl.tools.calculator_tool import CalculatorTool

SERVERS = []     # the engine servers to abort, set by the test
LIVE = set()     # instances created and not yet released
CALLS = []       # every execute, in order


class AbortingCalculator(CalculatorTool):
    """The calculator, which aborts the engine servers while it runs: the data flow's abort lands during a tool call."""

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id, **kwargs)
        LIVE.add(instance_id)
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        abort_servers(SERVERS)
        CALLS.append(dict(parameters))
        return await super().execute(instance_id, parameters, **kwargs)

    async def release(self, instance_id, **kwargs):
        LIVE.discard(instance_id)
        await super().release(instance_id, **kwargs)
'''


def test_an_abort_during_a_tool_call_lets_the_call_finish_and_the_next_turn_starts_on_resume(taught, tmp_path,
                                                                                             monkeypatch):
    """The abort comes while the tool runs: the call finishes and its message is appended, the next turn's request is
    answered aborted with no tokens; continued, the loop starts that turn (no tool call again). Nothing of the tool
    outlives either run."""
    _, tokenizer, model, _, conversation = taught
    (tmp_path / "aborting_tool.py").write_text(ABORTING_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import aborting_tool

    tool_yaml = tmp_path / "tools.yaml"
    tool_yaml.write_text(open(CALCULATOR_YAML).read().replace("hybridrl.tools.calculator_tool.CalculatorTool",
                                                              "aborting_tool.AbortingCalculator"))
    config = run_config(str(tool_yaml))
    eos = tokenizer.eos_token_id
    first = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [eos]
    second = tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [eos]
    sample = Sample(group_index=0, index=0, prompt_ids=[1, 2, 3], metadata={"raw_prompt": QUESTION,
                                                                            "tools_kwargs": {}})
    with serving(model, tokenizer, version=0) as server:
        aborting_tool.SERVERS[:] = [server.address]
        aborted = generate_sample(config, tokenizer, server, sample)
    response = conversation[len(aborted.prompt_ids):]
    inserted = len(response) - len(first) - len(second)
    assert (aborted.status, aborted.num_aborts) == (ABORTED, 1)
    assert aborted.response_ids == response[:len(first) + inserted]  # the call's answer appended, no token after
    assert aborted.token_versions == [0] * len(first) + [-1] * inserted
    assert aborted.loss_mask == [1] * len(first) + [0] * inserted
    assert aborted.resume_state["turn_start"] == len(first) + inserted  # the turn the abort cut before its start
    assert aborting_tool.CALLS == [{"expression": "12*34"}] and aborting_tool.LIVE == set()
    assert aborted.num_turns == 3 and aborted.metadata["tool_rewards"] == [0.0]

    with serving(model, tokenizer, version=1) as server:
        aborting_tool.SERVERS[:] = [server.address]
        done = generate_sample(config, tokenizer, server, aborted)
    assert (done.status, done.num_aborts, done.resume_state) == (COMPLETED, 1, None)
    assert done.prompt_ids + done.response_ids == conversation and done.prompt_ids == aborted.prompt_ids
    assert done.token_versions == [0] * len(first) + [-1] * inserted + [1] * len(second)
    assert done.loss_mask == [1] * len(first) + [0] * inserted + [1] * len(second)
    assert aborting_tool.CALLS == [{"expression": "12*34"}] and aborting_tool.LIVE == set()  # not called again
    assert done.agent_metrics["num_tool_calls"] == 1 and done.num_turns == 4
    assert done.metadata["tool_rewards"] == [0.0] and done.agent_metrics["tokenization_mismatch"] == 0


def test_an_aborted_sample_of_a_loop_that_cannot_resume_is_refused_at_run_time(taught, tmp_path):
    """A row's own agent_name escapes the config check (which reads default_agent_loop): the worker refuses to
    continue its aborted sample, naming the loop and what to do, before any request."""
    _, tokenizer, _, _, _ = taught
    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: react_agent\n  _target_: verl_style_agent.ReactAgentLoop\n")
    config = validate_config(compose_config([
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true", "actor_rollout_ref.actor.strategy=fsdp2",
        "trainer.device=cpu", f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        "data_flow.enable=true", "data_flow.partial_rollout=true"]))
    worker = AgentLoopWorker.__ray_actor_class__(config, tokenizer, ["127.0.0.1:9"])  # never contacted
    sample = Sample(group_index=0, index=7, prompt_ids=[1, 2], response_ids=[5], loss_mask=[1], token_versions=[0],
                    status=ABORTED, metadata={"agent_name": "react_agent", "raw_prompt": QUESTION})
    ctx = GenerateContext(server_manager=worker.server_manager, tokenizer=tokenizer, config=config,
                          response_length=RESPONSE_LENGTH)
    with pytest.raises(RuntimeError, match=r"sample 7 \(agent loop 'react_agent'\) was aborted mid-conversation .* "
                                           r"does not declare can_resume = True"):
        asyncio.run(worker._generate_sample(ctx, sample, dict(PARAMS)))
