"""tool_agent (hybridrl/agent_loop/tool_agent.py) and its parser, in process.

The loop runs against a scripted server manager: the engine boundary is faked only so that the model's turns
are known token by token (the real HF engine server path is covered in test_async_rollout.py and, for this
loop, in test_tool_agent_e2e below). Everything else is real: the tokenizer, its chat template, the tools.
"""
from __future__ import annotations

import asyncio
import math
import os

import pytest

from hybridrl.agent_loop.base import DictConfigWrap, TokenOutput
from hybridrl.agent_loop.tool_agent import ToolAgentLoop
from hybridrl.agent_loop.tool_parser import get_tool_parser, parse_hermes
from hybridrl.config import compose_config, validate_config
from hybridrl.defaults.tiny_model import build_tokenizer
from hybridrl.defaults.tool_chat_template import TOOL_CHAT_TEMPLATE
from hybridrl.tools.calculator_tool import evaluate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALCULATOR_YAML = os.path.join(REPO, "examples/sglang_multiturn/config/tool_config/calculator_tool_config.yaml")
GSM8K_YAML = os.path.join(REPO, "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml")


# ---- parser ----

def test_hermes_parses_one_call_and_keeps_the_text_around_it():
    content, calls = parse_hermes('Let me compute. <tool_call>{"name": "calculator", "arguments": '
                                  '{"expression": "12*34"}}</tool_call>')
    assert content == "Let me compute. "
    assert [(call.name, call.arguments, call.error) for call in calls] == [("calculator", {"expression": "12*34"},
                                                                            None)]


def test_hermes_parses_several_calls_in_order_and_string_encoded_arguments():
    _, calls = parse_hermes('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
                            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
    assert [(call.name, call.arguments) for call in calls] == [("a", {"x": 1}), ("b", {"y": 2})]


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": ', "not valid JSON"),
    ('["calculator"]', 'a string "name"'),
    ('{"name": "calculator", "arguments": [1]}', '"arguments"'),
])
def test_hermes_malformed_calls_come_back_with_an_error_not_an_exception(body, message):
    _, calls = parse_hermes(f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and message in calls[0].error


def test_unknown_format_is_refused_naming_the_supported_one():
    with pytest.raises(ValueError, match=r"multi_turn.format: expected one of \['gpt-oss', 'hermes'\], got 'json'"):
        get_tool_parser("json")


def test_calculator_is_exact_and_refuses_anything_but_arithmetic():
    assert evaluate("123456789*987654321") == 123456789 * 987654321
    assert evaluate("(7+5)//5 - 10/4") == 2 - 2.5
    assert evaluate("84/4") == 21 and isinstance(evaluate("84/4"), int)
    for bad in ("__import__('os')", "2**1000", "a+1"):
        with pytest.raises(ValueError):
            evaluate(bad)


# ---- the loop against a scripted engine ----

@pytest.fixture(scope="module")
def tokenizer():
    texts = ['<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>',
             "<tool_response> user assistant system Tools: calculator calc_gsm8k_reward answer Error",
             "What is 12*34? The answer is 408. Current parsed answer reward"] * 20
    built = build_tokenizer(texts, vocab_size=400)
    built.chat_template = TOOL_CHAT_TEMPLATE
    return built


class ScriptedServer:
    """server_manager.generate that answers each call with the next scripted text (+ EOS unless cut)."""

    def __init__(self, tokenizer, turns: list[str], cut_last: bool = False):
        self.tokenizer, self.turns, self.cut_last = tokenizer, list(turns), cut_last
        self.prompts: list[list[int]] = []
        self.max_tokens: list[int] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None) -> TokenOutput:
        self.prompts.append(list(prompt_ids))
        self.max_tokens.append(sampling_params["max_tokens"])
        text = self.turns.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not (self.cut_last and not self.turns):
            ids = ids + [self.tokenizer.eos_token_id]
        ids = ids[:sampling_params["max_tokens"]]
        stop = "length" if len(ids) == sampling_params["max_tokens"] and ids[-1] != self.tokenizer.eos_token_id \
            else "completed"
        return TokenOutput(token_ids=ids, log_probs=[-0.5 - i for i in range(len(ids))], stop_reason=stop)


def multi_turn_config(**overrides):
    """The run config (composed and validated) with multi_turn.<key>=<value> for each override, response_length the
    rollout's."""
    values = dict(tool_config_path=CALCULATOR_YAML)
    values.update(overrides)
    response_length = values.pop("response_length", 1000)
    return validate_config(compose_config(
        ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
         f"data.max_response_length={response_length}"]
        + [f"actor_rollout_ref.rollout.multi_turn.{key}={'null' if value is None else value}"
           for key, value in values.items()]))


def run_loop(tokenizer, server, config, raw_prompt=None, tools_kwargs=None):
    ToolAgentLoop._class_initialized = False  # each test builds the class's tools from its own config

    async def go():
        loop = ToolAgentLoop(DictConfigWrap(config), server_manager=server, tokenizer=tokenizer)
        return await loop.run({"temperature": 1.0, "logprobs": True},
                              raw_prompt=raw_prompt or [{"role": "user", "content": "What is 12*34?"}],
                              tools_kwargs=tools_kwargs or {})
    return asyncio.run(go())


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


def test_a_tool_turn_has_exact_tokens_masks_and_logprobs(tokenizer):
    server = ScriptedServer(tokenizer, [CALL, "The answer is 408."])
    output = run_loop(tokenizer, server, multi_turn_config())

    messages = [{"role": "user", "content": "What is 12*34?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "408"}, {"role": "assistant", "content": "The answer is 408."}]
    tools = [{"type": "function", "function": {"name": "calculator"}}]
    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False).removesuffix("\n")
    expected = tokenizer(full, add_special_tokens=False)["input_ids"]
    prompt_text = tokenizer.apply_chat_template(messages[:1], tools=tools, tokenize=False, add_generation_prompt=True)
    assert output.prompt_ids == tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    assert output.prompt_ids + output.response_ids == expected  # incremental == re-tokenised conversation

    first = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    second = tokenizer("The answer is 408.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    inserted = len(output.response_ids) - len(first) - len(second)
    assert tokenizer.decode(output.response_ids[len(first):len(first) + inserted]) == \
        "\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert output.response_mask == [1] * len(first) + [0] * inserted + [1] * len(second)
    assert output.response_logprobs == ([-0.5 - i for i in range(len(first))] + [0.0] * inserted +
                                        [-0.5 - i for i in range(len(second))])
    # the second turn was generated from the whole conversation so far, with what is left of the budget
    assert server.prompts[1] == output.prompt_ids + output.response_ids[:len(first) + inserted]
    assert server.max_tokens == [1000, 1000 - len(first) - inserted]
    assert output.num_turns == 4  # prompt + 2 assistant turns + 1 tool turn (verl's count)
    assert (output.metrics.num_tool_calls, output.metrics.num_tool_errors) == (1, 0)
    assert output.metrics.tokenization_mismatch == 0 and output.metrics.response_cut == 0
    assert output.reward_score is None and output.extra_fields["tool_rewards"] == [0.0]


def test_malformed_and_unknown_calls_are_answered_with_errors_and_counted(tokenizer):
    turns = ['<tool_call>{"name": "calculator", "arguments": </tool_call>',
             '<tool_call>{"name": "search", "arguments": {}}</tool_call>', "408"]
    output = run_loop(tokenizer, ScriptedServer(tokenizer, turns), multi_turn_config(response_length=1000))
    text = tokenizer.decode(output.response_ids)
    assert "Error: the tool call is not valid JSON" in text and "Error: no tool named 'search'" in text
    assert (output.metrics.num_tool_calls, output.metrics.num_tool_errors) == (2, 2)
    assert output.num_turns == 6 and output.metrics.tokenization_mismatch == 0


def test_turn_caps_stop_the_conversation(tokenizer):
    server = ScriptedServer(tokenizer, [CALL] * 5)
    output = run_loop(tokenizer, server, multi_turn_config(max_assistant_turns=3))
    assert output.num_turns == 3 + 2 + 1 and output.metrics.num_tool_calls == 2
    assert output.response_mask[-1] == 1  # ends on the model's turn
    server = ScriptedServer(tokenizer, [CALL] * 5)
    output = run_loop(tokenizer, server, multi_turn_config(max_user_turns=1))
    assert output.num_turns == 2 + 1 + 1 and output.metrics.num_tool_calls == 1


def test_parallel_calls_run_up_to_the_cap(tokenizer):
    two = CALL + "\n" + CALL.replace("12*34", "2*3") + "\n" + CALL
    output = run_loop(tokenizer, ScriptedServer(tokenizer, [two, "done"]), multi_turn_config(max_parallel_calls=2))
    text = tokenizer.decode(output.response_ids)
    assert "<tool_response>\n408\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>" in text
    assert output.metrics.num_tool_calls == 2 and output.metrics.tokenization_mismatch == 0


def test_the_response_budget_cuts_and_is_counted(tokenizer):
    call_tokens = len(tokenizer(CALL, add_special_tokens=False)["input_ids"]) + 1
    # the tool message does not fit: the conversation stops after the call, without it
    output = run_loop(tokenizer, ScriptedServer(tokenizer, [CALL, "x"]),
                      multi_turn_config(response_length=call_tokens + 5))
    assert len(output.response_ids) == call_tokens and output.metrics.response_cut == 1
    assert output.num_turns == 2
    # the model's own turn hits the budget
    output = run_loop(tokenizer, ScriptedServer(tokenizer, [CALL, "The answer is 408. " * 20], cut_last=True),
                      multi_turn_config(response_length=80))
    assert len(output.response_ids) == 80 and output.metrics.response_cut == 1 and output.response_mask[-1] == 1


def test_tool_output_is_truncated_on_the_configured_side(tokenizer):
    call = CALL.replace("12*34", "9**60")
    value = str(9 ** 60)
    for side, expected in (("left", value[:5] + "...(truncated)"), ("right", "(truncated)..." + value[-5:])):
        output = run_loop(tokenizer, ScriptedServer(tokenizer, [call, "ok"]),
                          multi_turn_config(max_tool_response_length=5, tool_response_truncate_side=side))
        assert f"<tool_response>\n{expected}\n</tool_response>" in tokenizer.decode(output.response_ids)


def test_tool_rewards_and_calc_reward_travel_as_extra_fields(tokenizer):
    call = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "408"}}</tool_call>'
    tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "408"}}}
    output = run_loop(tokenizer, ScriptedServer(tokenizer, [call, call, "done"]),
                      multi_turn_config(tool_config_path=GSM8K_YAML), tools_kwargs=tools_kwargs)
    assert output.extra_fields["tool_rewards"] == [0.0, -0.05]  # verl's penalty for a non-improving resubmission
    assert output.extra_fields["reward_scores"] == {"calc_gsm8k_reward": 1.0}
    assert output.reward_score is None  # the reward manager's score stays the sample's


@pytest.mark.parametrize("mode, counted, trained", [("strict", 1, False), ("ignore_strippable", 1, True),
                                                     ("disable", 0, True)])
def test_a_tokenization_mismatch_is_counted_and_the_mode_decides(tokenizer, mode, counted, trained):
    """strict: the sample is kept out of training; ignore_strippable: the same text split differently is
    accepted (and still counted); disable: not checked."""
    # the engine returns ids that decode to the call but are not how the tokenizer splits that text
    class Retokenizing(ScriptedServer):
        async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None):
            output = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            if len(self.prompts) == 1:  # spell the first merged token character by character
                ids = output.token_ids
                at = next(i for i, token in enumerate(ids[:-1]) if len(tokenizer.decode([token])) > 1)  # not EOS
                pieces = [piece for char in tokenizer.decode([ids[at]])
                          for piece in tokenizer(char, add_special_tokens=False)["input_ids"]]
                output.token_ids = ids[:at] + pieces + ids[at + 1:]
                output.log_probs = [-1.0] * len(output.token_ids)
            return output

    output = run_loop(tokenizer, Retokenizing(tokenizer, [CALL, "408"]),
                      multi_turn_config(tokenization_sanity_check_mode=mode))
    assert output.metrics.tokenization_mismatch == counted
    assert any(output.response_mask) is trained
    if not trained:
        assert output.reward_score == 0.0
    assert all(not math.isnan(value) for value in output.response_logprobs)


# ---- config: refused up front ----

def config_problems(*overrides: str) -> list[str]:
    from hybridrl.config import ConfigError, compose_config, validate_config
    try:
        validate_config(compose_config(list(overrides)))
    except ConfigError as err:
        return err.problems
    return []


def test_multi_turn_needs_async_mode_and_a_known_format():
    problems = config_problems("actor_rollout_ref.rollout.multi_turn.enable=true",
                               "actor_rollout_ref.rollout.multi_turn.format=json")
    assert any(p.startswith("actor_rollout_ref.rollout.mode: expected 'async' with actor_rollout_ref.rollout."
                            "multi_turn.enable=true") for p in problems), problems
    assert any("multi_turn.format: expected one of ['gpt-oss', 'hermes'], got 'json'" in p for p in problems), problems
    bad_side = config_problems("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top")
    assert any("tool_response_truncate_side" in p and "middle" in p for p in bad_side), bad_side
    bad_mode = config_problems("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=loose")
    assert any("tokenization_sanity_check_mode" in p and "ignore_strippable" in p for p in bad_mode), bad_mode


@pytest.mark.parametrize("entry, message", [
    ("  - class_name: hybridrl.tools.calculator_tool.NoSuchTool\n    config: {}\n"
     "    tool_schema: {type: function, function: {name: calc, description: d, parameters: {type: object}}}\n",
     "NoSuchTool"),
    ("  - class_name: hybridrl.tools.calculator_tool.CalculatorTool\n    config: {}\n"
     "    tool_schema: {type: function, function: {description: no name}}\n", "tools[0]"),
])
def test_a_bad_tool_yaml_is_refused_before_start_naming_file_and_entry(tmp_path, entry, message):
    from hybridrl.config import compose_config, validate_config
    from hybridrl.tools.config_checks import _check_tool_config

    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n" + entry)
    config = validate_config(compose_config([
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true", "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}"]))
    problems: list[str] = []
    _check_tool_config(config, problems)
    assert len(problems) == 1 and str(path) in problems[0] and message in problems[0], problems
    config.actor_rollout_ref.rollout.multi_turn.tool_config_path = CALCULATOR_YAML
    problems = []
    _check_tool_config(config, problems)
    assert problems == []


def test_parallel_calls_of_one_tool_share_one_instance_released_at_the_end(tokenizer):
    from hybridrl.tools.gsm8k_tool import Gsm8kTool

    call = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "408"}}</tool_call>'
    created, released = [], []
    original_create, original_release = Gsm8kTool.create, Gsm8kTool.release

    async def create(self, instance_id=None, **kwargs):
        result = await original_create(self, instance_id, **kwargs)
        created.append(result[0])
        return result

    async def release(self, instance_id, **kwargs):
        released.append(instance_id)
        await original_release(self, instance_id, **kwargs)

    tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "408"}}}
    Gsm8kTool.create, Gsm8kTool.release = create, release
    try:
        output = run_loop(tokenizer, ScriptedServer(tokenizer, [call + call, "done"]),
                          multi_turn_config(tool_config_path=GSM8K_YAML, max_parallel_calls=2),
                          tools_kwargs=tools_kwargs)
    finally:
        Gsm8kTool.create, Gsm8kTool.release = original_create, original_release
    assert output.metrics.num_tool_calls == 2 and len(created) == 1 and released == created
