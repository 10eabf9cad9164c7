"""verl's own SingleTurnAgentLoop and ToolAgentLoop, from every verl release of 2026, run here with `verl.` replaced by
`hybridrl.compat.verl.` in their import lines only (issue 57).

Each file is written, ported, into a folder on the path and registered through an agent-loop YAML (`_target_`, as
verl's YAML does); the loop is built as the agent-loop worker builds it (the run config as verl hands it, the worker's
tools in a ToolListWrap) and runs against a scripted engine. The expected tokens are worked out by hand from the chat
template below: the model's turns are the scripted ids (mask 1, their log-probs), every inserted turn the template's
text of it (mask 0, log-prob 0). Releases differ where verl changed its loops: 0.7.x and 0.8.0 append a tool turn
without the newline the template puts after the model's <|im_end|>; 0.9.0 restores it (turn_separator) and 0.9.1's
Continuous Token appends the template's delta from just after <|im_end|>, newline included. Only 0.7.x's tool loop
runs interactions; 0.7.0-0.9.0's format the gpt-oss tool responses by hand (verl.experimental.agent_loop.utils).

The end-to-end 2-step training runs of the built-in tool task with the ported ToolAgentLoop: the latest release in
the default tier, the others in the slow tier.
"""
import asyncio
import os
import re
import textwrap

import pytest

from hybridrl.agent_loop.base import DictConfigWrap, ToolListWrap, instantiate_agent_loop, load_agent_loop_config
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager
from hybridrl.config import compose_config, validate_config
from hybridrl.defaults.tiny_model import build_tokenizer
from hybridrl.tools import initialize_tools_from_config
from verl_release import LATEST, RELEASES, port, verl_release

TESTS = os.path.dirname(os.path.abspath(__file__))
# ChatML with a default system prompt (as Qwen2.5's template adds one) and tool messages as user turns
TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe exact.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}")
PROMPT = "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nWhat is 12*34?<|im_end|>\n<|im_start|>assistant\n"
HERMES_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'
GPT_OSS_CALL = ('<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{"expression": "12*34"}'
                '<|call|>')
TOOL_TURN = "<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
# 0.9.x put the template's newline after the model's <|im_end|> before the tool turn; earlier releases do not
TOOL_TURN_BY_RELEASE = {"0.7.0": TOOL_TURN, "0.7.1": TOOL_TURN, "0.8.0": TOOL_TURN, "0.9.0": "\n" + TOOL_TURN,
                        "0.9.1": "\n" + TOOL_TURN}
ANSWER = "The answer is 408."


@pytest.fixture(autouse=True)
def agent_loop_registry_restored():
    """verl's tool loop registers itself as "tool_agent" on import: later tests see the built-in one again."""
    from hybridrl.agent_loop import base

    saved = base.load_agent_loop_config(None)
    yield
    base._agent_loop_registry.clear()
    base._agent_loop_registry.update(saved)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [HERMES_CALL, GPT_OSS_CALL, TOOL_TURN, "<|start|>functions.calculator to=assistant<|end|><|start|>",
             "system Be exact. What is 12*34? The answer is 408. 400 Correct. Try again."] * 20
    built = build_tokenizer(texts, vocab_size=400)
    built.chat_template = TEMPLATE
    return built


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def write(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


def ported_loop(version: str, loop_file: str, folder, monkeypatch) -> str:
    """verl's `loop_file` of `version`, ported, as a module in `folder` on the path; its module name."""
    module = f"verl_{version.replace('.', '_')}_{loop_file}"
    source = (verl_release(version) / "verl" / "experimental" / "agent_loop" / f"{loop_file}.py").read_text()
    (folder / f"{module}.py").write_text(port(source))
    monkeypatch.syspath_prepend(str(folder))
    return module


def loop_yaml(folder, entries: dict[str, str]) -> str:
    """An agent-loop YAML naming each loop's class by `_target_`, as verl's agent_loop_config_path does."""
    return write(folder / "agent_loops.yaml", "".join(f"- name: {name}\n  _target_: {target}\n"
                                                      for name, target in entries.items()))


@pytest.fixture
def tools_yaml(tmp_path):
    """verl's tool YAML layout; the calculator checks its product against the sample's tools_kwargs ground truth."""
    return write(tmp_path / "tools.yaml", """\
        tools:
          - class_name: verl_style_agent.CheckedCalculatorTool
            config: {type: native}
            tool_schema: null
        """)


def run_config(tools_yaml, loops_yaml, *overrides):
    return validate_config(compose_config([
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true", "data.max_response_length=200",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_yaml}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops_yaml}", *overrides]))


class ScriptedServer(AsyncLLMServerManager):
    """hybridrl's server manager (its generate takes verl's arguments of every release and refuses media), with an
    engine that answers each request with the next scripted text + EOS, each token's log-prob -1."""

    def __init__(self, tokenizer, turns):
        super().__init__(["scripted:0"])
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def _post(self, server: str, payload: dict) -> dict:
        self.prompts.append(payload["prompt_ids"])
        token_ids = ids(self.tokenizer, self.turns.pop(0)) + [self.tokenizer.eos_token_id]
        return {"token_ids": token_ids, "log_probs": [-1.0] * len(token_ids), "num_preempted": 0}


def run_ported(name, config, tokenizer, server, row):
    """Build the loop registered as `name` as the agent-loop worker does, and run it on `row`."""
    registry = load_agent_loop_config(config.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    tools = ToolListWrap(initialize_tools_from_config(config.actor_rollout_ref.rollout.multi_turn.tool_config_path))

    async def go():
        verl_view = DictConfigWrap(config).config
        loop = instantiate_agent_loop(name, registry, trainer_config=DictConfigWrap(verl_view), server_manager=server,
                                      tokenizer=tokenizer, processor=None, data_config=DictConfigWrap(verl_view.data),
                                      tools=tools)
        return await loop.run({"temperature": 1.0, "logprobs": True}, **row)
    return asyncio.run(go())


def row(**extra_info):
    return {"raw_prompt": [{"role": "user", "content": "What is 12*34?"}], "data_source": "arithmetic",
            "extra_info": {"index": 0, **extra_info},
            "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "408"}}}}


def expected_response(tokenizer, pieces):
    """(ids, mask, log-probs) of (text, by_model) pieces: a model's turn is its ids + EOS (mask 1, log-prob -1), an
    inserted one the ids of its text (mask 0, log-prob 0)."""
    response, mask, logprobs = [], [], []
    for text, by_model in pieces:
        piece = ids(tokenizer, text) + ([tokenizer.eos_token_id] if by_model else [])
        response += piece
        mask += [int(by_model)] * len(piece)
        logprobs += [-1.0 if by_model else 0.0] * len(piece)
    return response, mask, logprobs


# ---- (a) each release's loops in process, against a scripted engine

@pytest.mark.parametrize("version", list(RELEASES))
def test_verls_single_turn_loop_runs_unchanged_but_for_imports(version, tokenizer, tools_yaml, tmp_path, monkeypatch):
    module = ported_loop(version, "single_turn_agent_loop", tmp_path, monkeypatch)
    config = run_config(tools_yaml, loop_yaml(tmp_path, {"verl_single": f"{module}.SingleTurnAgentLoop"}))
    server = ScriptedServer(tokenizer, [ANSWER])
    output = run_ported("verl_single", config, tokenizer, server, row())

    assert output.prompt_ids == ids(tokenizer, PROMPT) == server.prompts[0]
    response, mask, logprobs = expected_response(tokenizer, [(ANSWER, True)])
    assert (output.response_ids, output.response_mask, output.response_logprobs) == (response, mask, logprobs)
    assert output.num_turns == 2 and output.metrics.generate_sequences > 0
    # from 0.7.1 the engine's preemption count is read and the extra fields share the tool loop's schema
    assert output.metrics.num_preempted == (-1 if version == "0.7.0" else 0)
    assert output.extra_fields == ({} if version == "0.7.0" else {"turn_scores": [], "tool_rewards": []})


@pytest.mark.parametrize("version", list(RELEASES))
def test_verls_tool_loop_runs_a_tool_call_round_trip_unchanged_but_for_imports(version, tokenizer, tools_yaml,
                                                                              tmp_path, monkeypatch):
    module = ported_loop(version, "tool_agent_loop", tmp_path, monkeypatch)
    config = run_config(tools_yaml, loop_yaml(tmp_path, {"verl_tool": f"{module}.ToolAgentLoop"}))
    server = ScriptedServer(tokenizer, [HERMES_CALL, ANSWER])
    output = run_ported("verl_tool", config, tokenizer, server, row())

    assert output.prompt_ids == ids(tokenizer, PROMPT)
    response, mask, logprobs = expected_response(tokenizer, [(HERMES_CALL, True),
                                                             (TOOL_TURN_BY_RELEASE[version], False), (ANSWER, True)])
    assert (output.response_ids, output.response_mask, output.response_logprobs) == (response, mask, logprobs)
    # the second request continues the conversation token for token
    assert server.prompts[1] == output.prompt_ids + response[:len(response) - len(ids(tokenizer, ANSWER)) - 1]
    # the calculator got the sample's ground truth from tools_kwargs: its product 408 earned 1
    assert output.extra_fields["tool_rewards"] == [1.0] and output.extra_fields["turn_scores"] == []
    assert output.num_turns == 4  # 2 model turns + 1 tool turn + 1
    assert output.metrics.generate_sequences > 0 and output.metrics.tool_calls > 0


@pytest.mark.parametrize("version", ["0.7.0", "0.7.1"])
def test_verls_tool_loop_of_0_7_answers_turns_without_a_call_with_the_interaction(version, tokenizer, tools_yaml,
                                                                               tmp_path, monkeypatch):
    """0.7.x's ToolAgentLoop runs interactions (0.8 moved them out of it): a wrong answer is answered "Try again."
    and scored 0, the right one ends the conversation with 1."""
    module = ported_loop(version, "tool_agent_loop", tmp_path, monkeypatch)
    interactions = write(tmp_path / "interactions.yaml", """\
        interaction:
          - name: exact
            class_name: verl_style_agent.ExactAnswerInteraction
            config: {}
        """)
    config = run_config(tools_yaml, loop_yaml(tmp_path, {"verl_tool": f"{module}.ToolAgentLoop"}),
                        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={interactions}")
    server = ScriptedServer(tokenizer, [HERMES_CALL, "The answer is 400.", ANSWER])
    output = run_ported("verl_tool", config, tokenizer, server,
                        row(interaction_kwargs={"name": "exact", "ground_truth": "408"}))

    response, mask, logprobs = expected_response(tokenizer, [
        (HERMES_CALL, True), (TOOL_TURN, False), ("The answer is 400.", True),
        ("<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n", False), (ANSWER, True),
        ("<|im_start|>user\nCorrect.<|im_end|>\n<|im_start|>assistant\n", False)])
    # the conversation ends on the interaction's closing turn, inserted as verl 0.7 does
    assert (output.response_ids, output.response_mask, output.response_logprobs) == (response, mask, logprobs)
    assert output.extra_fields["turn_scores"] == [0.0, 1.0] and output.extra_fields["tool_rewards"] == [1.0]
    assert output.num_turns == 7  # 3 model turns + 1 tool turn + 2 interaction turns + 1


@pytest.mark.parametrize("version", ["0.7.0", "0.7.1", "0.8.0", "0.9.0"])
def test_verls_tool_loop_formats_gpt_oss_tool_responses_with_the_compat_helper(version, tokenizer, tools_yaml,
                                                                             tmp_path, monkeypatch):
    """multi_turn.format=gpt-oss: the call is parsed from harmony's syntax and the tool turn is the text
    build_gpt_oss_tool_response_text writes (verl.experimental.agent_loop.utils), generation prompt included."""
    module = ported_loop(version, "tool_agent_loop", tmp_path, monkeypatch)
    config = run_config(tools_yaml, loop_yaml(tmp_path, {"verl_tool": f"{module}.ToolAgentLoop"}),
                        "actor_rollout_ref.rollout.multi_turn.format=gpt-oss")
    server = ScriptedServer(tokenizer, [GPT_OSS_CALL, ANSWER])
    output = run_ported("verl_tool", config, tokenizer, server, row())

    tool_turn = "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>408<|end|><|start|>assistant"
    response, mask, logprobs = expected_response(tokenizer, [(GPT_OSS_CALL, True), (tool_turn, False),
                                                             (ANSWER, True)])
    assert (output.response_ids, output.response_mask, output.response_logprobs) == (response, mask, logprobs)
    assert output.extra_fields["tool_rewards"] == [1.0]


@pytest.mark.parametrize("version", list(RELEASES))
@pytest.mark.parametrize("loop_file", ["single_turn_agent_loop", "tool_agent_loop"])
def test_every_verl_name_the_loops_import_is_mirrored(version, loop_file, tmp_path, monkeypatch):
    from hybridrl.agent_loop.verl_imports import unprovided_verl_imports

    assert unprovided_verl_imports(ported_loop(version, loop_file, tmp_path, monkeypatch)) == []


# ---- (c) a verl name hybridrl lacks is refused before Ray starts

def test_a_loop_importing_a_verl_name_hybridrl_lacks_is_refused_before_ray_starts(tools_yaml, tmp_path, monkeypatch):
    from hybridrl.agent_loop.config_checks import _check_agent_loops

    (tmp_path / "wants_more.py").write_text(textwrap.dedent("""\
        from hybridrl.compat.verl.experimental.agent_loop.agent_loop import AgentLoopBase, register
        from hybridrl.compat.verl.experimental.agent_loop.no_such_thing import helper


        @register("wants_more")
        class WantsMore(AgentLoopBase):
            async def run(self, sampling_params, **kwargs):
                return helper()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    loops = loop_yaml(tmp_path, {"wants_more": "wants_more.WantsMore"})
    problems: list[str] = []
    _check_agent_loops(run_config(tools_yaml, loops), problems)
    assert problems == [
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path: expected agent loops whose verl imports "
        f"hybridrl.compat.verl provides, got entry 0 ('wants_more') of {loops}: {tmp_path / 'wants_more.py'} line 2 "
        f"imports verl.experimental.agent_loop.no_such_thing, which hybridrl does not provide "
        f"(hybridrl/compat/verl/README.md lists what it does)"]


# ---- (b) the built-in tool task trains 2 steps driven by verl's ported ToolAgentLoop (real Ray, 2 gloo ranks)

@pytest.fixture(scope="module")
def builtin_tool_task(tmp_path_factory):
    """The small tool task (test_verl_compat.small_tool_task), its rows run by the loop registered as
    verl_tool_agent."""
    from test_verl_compat import small_tool_task

    return small_tool_task(tmp_path_factory.mktemp("builtin_tool_task"), "verl_tool_agent")


def train_two_steps_with_verls_tool_loop(version, task, tools_yaml, tmp_path, monkeypatch):
    from test_async_rollout import fit_keeping_update_batches
    from test_e2e_training import read_metrics
    from test_verl_compat import tool_task_run_config

    module = ported_loop(version, "tool_agent_loop", tmp_path, monkeypatch)
    # the Ray workers import the ported loop (tmp_path) and the calculator (tests/)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), TESTS, os.environ.get("PYTHONPATH", "")]))
    loops = loop_yaml(tmp_path, {"verl_tool_agent": f"{module}.ToolAgentLoop"})
    config = tool_task_run_config(task, str(tmp_path), tools_yaml, loops, "verl_tool_agent")
    trainer, batches = fit_keeping_update_batches(config)
    steps = read_metrics(str(tmp_path))
    assert len(steps) == 2 and all(step["agent_loop/num_failed"] == 0 for step in steps)
    tool_turn_start = ("\n" if version.startswith("0.9") else "") + "<|im_start|>user\n<tool_response>\n"
    tool_calls = 0
    for batch in batches:
        response_mask = batch.batch["response_mask"]
        attention = batch.batch["attention_mask"][:, -response_mask.shape[1]:].bool()
        for row in range(len(batch)):
            inserted = attention[row] & ~response_mask[row].bool()
            inserted_text = trainer.tokenizer.decode(batch.batch["responses"][row][inserted].tolist())
            # each tool turn in the release's layout, masked, with no advantage and no log-prob
            answered = re.findall(re.escape(tool_turn_start) + r"(.*?)\n</tool_response><\|im_end\|>\n"
                                  r"<\|im_start\|>assistant\n", inserted_text)
            assert "".join(tool_turn_start + value + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
                           for value in answered) == inserted_text
            assert batch.batch["advantages"][row][inserted].abs().sum() == 0
            assert batch.batch["rollout_log_probs"][row][inserted].abs().sum() == 0
            assert response_mask[row][attention[row]][-1] == 1  # every conversation ends on the model's turn
            # each answer equal to the question's product earned 1: the ground truth came from tools_kwargs
            product = batch.non_tensor_batch["reward_model"][row]["ground_truth"]
            assert batch.non_tensor_batch["tool_rewards"][row] == [float(value == product) for value in answered]
            tool_calls += len(answered)
    assert tool_calls > 0
    assert sum(step["timing_s/agent_loop/generate_sequences/mean"] for step in steps) > 0


@pytest.mark.timeout(900)  # the task's warm start (200 SFT steps) takes about 2.5 CPU-minutes before the run
def test_the_builtin_tool_task_trains_two_steps_driven_by_the_latest_verl_tool_loop(ray_local, builtin_tool_task,
                                                                                  tools_yaml, tmp_path, monkeypatch):
    train_two_steps_with_verls_tool_loop(LATEST, builtin_tool_task, tools_yaml, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("version", [version for version in RELEASES if version != LATEST])
def test_the_builtin_tool_task_trains_two_steps_driven_by_an_earlier_verl_tool_loop(version, ray_local,
                                                                                   builtin_tool_task, tools_yaml,
                                                                                   tmp_path, monkeypatch):
    train_two_steps_with_verls_tool_loop(version, builtin_tool_task, tools_yaml, tmp_path, monkeypatch)
