"""The pieces verl's agent loops of 2026 use here, each against a hand computation: the config as verl hands it, the
Continuous Token merges, the gpt-oss format, function-tool returns, and the server manager's verl arguments."""
import asyncio
import pickle

import pytest

from hybridrl.agent_loop.continuous_token import ContinuousTokenBuilder, MergeResult
from hybridrl.agent_loop.gpt_oss import build_gpt_oss_tool_response_text, parse_gpt_oss
from hybridrl.agent_loop.server_manager import AsyncLLMServerManager
from hybridrl.agent_loop.verl_config import unwrap, verl_config
from hybridrl.config import compose_config, validate_config
from hybridrl.tools.function_tool import normalize_function_tool_return
from hybridrl.tools.schemas import ToolResponse



@pytest.fixture(scope="module")
def config():
    return validate_config(compose_config([
        "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=/x/tools.yaml", "+data.apply_chat_template_kwargs.a=1"]))


def test_a_loop_reads_hybridrls_keys_and_verls_derived_ones_by_attribute_get_item_and_in(config):
    view = verl_config(config)
    data = view.data
    assert data.tool_config_path == data.get("tool_config_path") == data["tool_config_path"] == "/x/tools.yaml"
    assert "tool_config_path" in data and "no_such_key" not in data and data.get("no_such_key", 7) == 7
    assert data.get("apply_chat_template_kwargs", {}) == {"a": 1}
    assert data.max_prompt_length == config.data.max_prompt_length
    rollout = view.actor_rollout_ref.rollout
    assert rollout.full_determinism is False
    assert rollout.multi_turn.max_user_turns == config.actor_rollout_ref.rollout.multi_turn.max_user_turns
    assert unwrap(rollout) is config.actor_rollout_ref.rollout and verl_config(view) is view
    with pytest.raises(AttributeError, match=r"^the run config has no key 'actor_rollout_ref.rollout.trace' "):
        rollout.trace
    with pytest.raises(KeyError, match="data.no_such_key"):
        data["no_such_key"]
    with pytest.raises(AttributeError, match="data.max_prompt_length: the config an agent loop gets is read-only"):
        data.max_prompt_length = 3
    assert pickle.loads(pickle.dumps(view)).data.tool_config_path == "/x/tools.yaml"  # it travels to Ray workers


def test_continuous_token_merges_extend_mask_and_log_probs_by_hand():
    builder = ContinuousTokenBuilder(tokenizer=None)
    assistant = builder.merge_assistant_tokens([1, 2], [3, 4])
    assert assistant == MergeResult([1, 2, 3, 4], 2, kind="assistant")
    assert builder.align_response_metadata(assistant, [0], [0.0], assistant_logprobs=[-0.5, -0.25]) == \
        ([0, 1, 1], [0.0, -0.5, -0.25])
    assert builder.align_response_metadata(assistant, [], None) == ([1, 1], None)
    context = MergeResult([1, 2, 3, 4, 5, 6, 7], 3, kind="context")
    assert builder.align_response_metadata(context, [1], [-1.0]) == ([1, 0, 0, 0], [-1.0, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="1 assistant log-probs for 2 generated ids"):
        builder.align_response_metadata(assistant, [], [], assistant_logprobs=[-1.0])
    with pytest.raises(ValueError, match="must start with previous_messages unchanged"):
        builder.merge_context_tokens([{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}], [1])


def test_gpt_oss_calls_are_parsed_outside_the_reasoning_and_tool_turns_written_in_harmony():
    text = ('<|channel|>analysis<|message|>maybe to=functions.fake <|constrain|>json<|message|>{}<|call|><|end|>'
            '<|start|>assistant<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>'
            '{"expression": "2*3"}<|call|>')
    content, calls = parse_gpt_oss(text)
    assert [(call.name, call.arguments, call.error) for call in calls] == [("calculator", {"expression": "2*3"}, None)]
    assert content == ""
    _, [bad] = parse_gpt_oss('<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1]<|call|>')
    assert bad.name == "f" and bad.error == "the arguments of a call to 'f' must be a JSON object, got '[1]'"
    assert build_gpt_oss_tool_response_text([{"role": "tool", "content": "6"}, {"role": "tool", "content": "x"}],
                                            ["calculator", "search"]) == (
        "<|start|>functions.calculator to=assistant<|channel|>commentary<|message|>6<|end|>"
        "<|start|>functions.search to=assistant<|channel|>commentary<|message|>x<|end|><|start|>assistant")


def test_a_function_tools_return_becomes_response_reward_and_metrics():
    assert normalize_function_tool_return("6") == (ToolResponse(text="6"), 0.0, {})
    assert normalize_function_tool_return({"v": 6}) == (ToolResponse(text='{"v": 6}'), 0.0, {})
    assert normalize_function_tool_return(("6", None)) == (ToolResponse(text="6"), 0.0, {})
    assert normalize_function_tool_return((ToolResponse(text="6"), 1, {"n": 2})) == (ToolResponse(text="6"), 1.0,
                                                                                     {"n": 2})
    assert normalize_function_tool_return(6) == (ToolResponse(text="6"), 0.0, {})
    with pytest.raises(TypeError, match="got 4 items"):
        normalize_function_tool_return(("a", 1, {}, 2))


@pytest.mark.parametrize("arguments, refused", [
    ({"audio_data": [b"x"]}, "audio_data given, but the engines here serve text-only models"),
    ({"image_data": [1], "mm_processor_kwargs": {"fps": 2}}, "image_data, mm_processor_kwargs given"),
    ({"priority": 3}, "priority=3, but the engine servers here answer requests in arrival order (only priority 0)"),
])
def test_the_server_manager_takes_verls_arguments_and_refuses_what_text_only_engines_cannot_serve(arguments, refused):
    manager = AsyncLLMServerManager(["127.0.0.1:9"])
    with pytest.raises(NotImplementedError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(manager.generate("r", prompt_ids=[1], sampling_params={}, **arguments))
