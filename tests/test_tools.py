"""hybridrl.tools without the sandbox: schemas, the YAML loader and its refusals, the GSM8K tool,
run_tool_call's fault containment, per-sample tools_kwargs, truncation, and a verl tool ported by imports."""
import asyncio
import logging
import re
import textwrap

import pytest
import yaml

from hybridrl.tools import (BaseTool, OpenAIFunctionCallSchema, OpenAIFunctionParsedSchema, OpenAIFunctionToolSchema,
                            ToolConfigError, ToolResponse, check_tools_kwargs, initialize_tools_from_config,
                            run_tool_call, tool_phase_kwargs, truncate_text)
from hybridrl.tools.gsm8k_tool import Gsm8kTool

REPO_GSM8K_YAML = "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml"


def schema(name="echo", **parameters_override):
    parameters = {"type": "object", "properties": {"text": {"type": "string", "description": "what to echo"}},
                  "required": ["text"], **parameters_override}
    return {"type": "function", "function": {"name": name, "description": "echo text", "parameters": parameters}}


def write_yaml(path, body: str) -> str:
    path.write_text(textwrap.dedent(body))
    return str(path)


class EchoTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text=parameters["text"]), 0.5, {"echoed": 1}


class RaisingTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise KeyError("boom")


class HangingTool(BaseTool):
    cancelled = False

    async def execute(self, instance_id, parameters, **kwargs):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            HangingTool.cancelled = True
            raise


class BadReturnTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return "just a string"


class StrReturnTool(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return "plain text", None, None  # verl's older tools return str and None reward/metrics


def tool_of(cls, name="echo"):
    return cls(config={}, tool_schema=OpenAIFunctionToolSchema.model_validate(schema(name)))


# ---- schemas ------------------------------------------------------------------------------------

def test_schema_round_trip_and_extra_json_schema_keywords_kept():
    raw = schema(properties={"n": {"type": "integer", "minimum": 0, "description": "count"},
                             "tags": {"type": "array", "items": {"type": "string"}}}, required=["n"])
    parsed = OpenAIFunctionToolSchema.model_validate(raw)
    assert parsed.function.parameters.properties["n"].model_dump(exclude_none=True) == {
        "type": "integer", "description": "count", "minimum": 0}
    assert parsed.model_dump(exclude_unset=True, exclude_none=True) == raw


@pytest.mark.parametrize("arguments, decoded, failed", [
    ('{"text": "hi"}', {"text": "hi"}, False), ("{not json", {}, True), ("[1, 2]", {}, True)])
def test_parsed_call_decodes_arguments(arguments, decoded, failed):
    call, decode_failed = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(
        OpenAIFunctionParsedSchema(name="echo", arguments=arguments))
    assert (call.name, call.arguments, decode_failed) == ("echo", decoded, failed)


def test_tool_response_media_must_be_lists():
    assert ToolResponse(text="a", image=["img"]).is_text_only() is False
    assert ToolResponse().is_empty()
    with pytest.raises(ValueError, match="image must be a list"):
        ToolResponse(image="img")


# ---- YAML loading and its refusals --------------------------------------------------------------

def test_repo_gsm8k_yaml_loads_the_gsm8k_tool():
    (tool,) = initialize_tools_from_config(REPO_GSM8K_YAML)
    assert isinstance(tool, Gsm8kTool) and tool.name == "calc_gsm8k_reward"
    assert tool.config == {"type": "native"}
    assert tool.get_openai_tool_schema().function.parameters.required == ["answer"]


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        initialize_tools_from_config(str(tmp_path / "nope.yaml"))


def _second_schema(**parameters_override):
    return schema("second", **parameters_override)


def _without_description():
    raw = schema("second")
    del raw["function"]["description"]
    return raw


@pytest.mark.parametrize("entry, expected", [
    ({"class_name": "no_such_module.Tool", "tool_schema": _second_schema()},
     r"tools\[1\] \('second'\): cannot import class_name 'no_such_module.Tool': ModuleNotFoundError"),
    ({"class_name": "test_tools.NoSuchTool", "tool_schema": _second_schema()},
     r"tools\[1\] \('second'\): cannot import class_name 'test_tools.NoSuchTool': AttributeError"),
    ({"class_name": "collections.OrderedDict", "tool_schema": _second_schema()},
     r"tools\[1\] \('second'\): class_name 'collections.OrderedDict' is .*expected a subclass of .*BaseTool"),
    ({"class_name": "test_tools.EchoTool"},
     r"tools\[1\]: test_tools.EchoTool\(config=\{\}\) failed: ValueError: EchoTool has no tool_schema: give one "
     r"in the YAML entry, or override get_openai_tool_schema\(\) to return it"),
    ({"class_name": "test_tools.EchoTool", "tool_schema": _second_schema(type="array")},
     r"tools\[1\] \('second'\): invalid tool_schema: tool_schema.function.parameters.type: Input should be 'object'"),
    ({"class_name": "test_tools.EchoTool", "tool_schema": _second_schema(required=["missing"])},
     r"tools\[1\] \('second'\): invalid tool_schema: .*required names \['missing'\] are not among properties"),
    ({"class_name": "test_tools.EchoTool", "tool_schema": _without_description()},
     r"tools\[1\] \('second'\): invalid tool_schema: tool_schema.function.description: Field required"),
    ({"class_name": "test_tools.EchoTool", "config": {"type": "mcp"}, "tool_schema": _second_schema()},
     r"tools\[1\] \('second'\): config.type='mcp'; only 'native' tools are supported"),
    ({"class_name": "test_tools.EchoTool", "tool_schma": _second_schema()},
     r"tools\[1\]: unknown keys \['tool_schma'\]"),
    ({"class_name": "test_tools.EchoTool", "tool_schema": schema("first")},
     r"tools\[1\] and tools\[0\] are both named 'first'"),
])
def test_bad_entries_are_refused_naming_file_and_entry(tmp_path, entry, expected):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [{"class_name": "test_tools.EchoTool", "tool_schema": schema("first")},
                                              entry]}))
    with pytest.raises(ToolConfigError, match=re.escape(str(path)) + ": " + expected):
        initialize_tools_from_config(str(path))


def test_a_tool_whose_constructor_fails_is_refused_naming_the_entry(tmp_path):
    path = write_yaml(tmp_path / "tools.yaml", """\
        tools:
          - class_name: hybridrl.tools.code_interpreter_tool.CodeInterpreterTool
            config: {timeout: 3}
            tool_schema: {type: function, function: {name: code_interpreter, description: run code,
                          parameters: {type: object, properties: {code: {type: string}}, required: [code]}}}
        """)
    with pytest.raises(ToolConfigError, match=r"tools\[0\] \('code_interpreter'\): .*CodeInterpreterTool\(config="
                                               r".*ValueError: unknown config keys \['timeout'\]"):
        initialize_tools_from_config(path)


def test_a_verl_tool_ports_by_changing_imports_only(tmp_path, monkeypatch):
    """verl's tool shape (rollout_trace_op, tuple returns, _instance_dict) with `verl` replaced by `hybridrl`."""
    (tmp_path / "ported_tool.py").write_text(textwrap.dedent("""\
        from typing import Any, Optional
        from uuid import uuid4

        from hybridrl.tools.base_tool import BaseTool
        from hybridrl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
        from hybridrl.utils.rollout_trace import rollout_trace_op


        class CounterTool(BaseTool):
            def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
                super().__init__(config, tool_schema)
                self._instance_dict = {}

            async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
                instance_id = instance_id or str(uuid4())
                self._instance_dict[instance_id] = {"count": kwargs.get("start", 0)}
                return instance_id, ToolResponse()

            @rollout_trace_op
            async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs):
                self._instance_dict[instance_id]["count"] += int(parameters["step"])
                return ToolResponse(text=str(self._instance_dict[instance_id]["count"])), 0.0, {}

            async def calc_reward(self, instance_id: str, **kwargs) -> float:
                return float(self._instance_dict[instance_id]["count"])

            async def release(self, instance_id: str, **kwargs) -> None:
                del self._instance_dict[instance_id]
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write_yaml(tmp_path / "tools.yaml", """\
        tools:
          - class_name: ported_tool.CounterTool
            config: {type: native, step_limit: 3}
            tool_schema:
              type: function
              function:
                name: counter
                description: add step to a counter
                parameters: {type: object, properties: {step: {type: integer}}, required: [step]}
        """)
    (tool,) = initialize_tools_from_config(path)
    assert tool.config == {"type": "native", "step_limit": 3}

    async def trajectory():
        instance_id, _ = await tool.create("traj-1", **tool_phase_kwargs({"counter": {"create_kwargs": {"start": 10}}},
                                                                         "counter", "create"))
        outcome = await run_tool_call(tool, instance_id, {"step": 5}, timeout_s=5)
        reward = await tool.calc_reward(instance_id)
        await tool.release(instance_id)
        return outcome, reward
    outcome, reward = asyncio.run(trajectory())
    assert (outcome.response.text, outcome.error, reward) == ("15", None, 15.0)


class SelfDescribedTool(BaseTool):
    """verl's tutorial shape (its SandboxTool, its test WeatherTool): the YAML says tool_schema: null and the class
    gives its own schema, here a function without parameters."""

    def get_openai_tool_schema(self):
        return OpenAIFunctionToolSchema.model_validate(
            {"type": "function", "function": {"name": "get_time", "description": "the current time"}})


def test_a_tool_without_a_yaml_schema_describes_itself_and_parameters_are_optional(tmp_path):
    path = write_yaml(tmp_path / "tools.yaml", """\
        tools:
          - class_name: test_tools.SelfDescribedTool
            config: {type: native}
            tool_schema: null
        """)
    (tool,) = initialize_tools_from_config(path)
    assert tool.name == "get_time" and tool.tool_schema.function.parameters.properties == {}
    # what the chat template gets: no parameters invented for a function that declares none
    assert tool.get_openai_tool_schema().model_dump(exclude_unset=True, exclude_none=True) == {
        "type": "function", "function": {"name": "get_time", "description": "the current time"}}


# ---- GSM8K tool ----------------------------------------------------------------------------------

def test_gsm8k_tool_scores_answers_and_penalises_non_improving_ones():
    (tool,) = initialize_tools_from_config(REPO_GSM8K_YAML)

    async def trajectory():
        instance_id, created = await tool.create(ground_truth="1234")
        steps = [await tool.execute(instance_id, {"answer": answer}) for answer in ("12", "1,234", "#### 1234")]
        final = await tool.calc_reward(instance_id)
        malformed = await tool.execute(instance_id, {"answr": "1234"})
        await tool.release(instance_id)
        return created, steps, final, malformed
    created, steps, final, malformed = asyncio.run(trajectory())
    assert created.is_empty()
    assert [(reward, response.text) for response, reward, _ in steps] == [
        (-0.05, "Current parsed answer='12' reward=0.0"),       # wrong: not an improvement on 0
        (0.0, "Current parsed answer='1,234' reward=1.0"),      # right: improved
        (-0.05, "Current parsed answer='#### 1234' reward=1.0"),  # right again, but no improvement
    ]
    assert final == 1.0
    response, reward, metrics = malformed
    assert response.text.startswith("Error: calc_gsm8k_reward expects arguments {\"answer\"") and reward == -0.05
    assert metrics == {"malformed_parameters": 1}


def test_gsm8k_tool_takes_ground_truth_from_tools_kwargs_or_refuses_without():
    (tool,) = initialize_tools_from_config(REPO_GSM8K_YAML)
    tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "7"}}}

    async def run(nested: bool):
        create_kwargs = tool_phase_kwargs(tools_kwargs, tool.name, "create")
        # verl's tool_agent_loop nests them (create_kwargs=...); its older rollout spread them
        created = tool.create(create_kwargs=create_kwargs) if nested else tool.create(**create_kwargs)
        instance_id, _ = await created
        _, _, _ = await tool.execute(instance_id, {"answer": "7"})
        return await tool.calc_reward(instance_id)
    assert asyncio.run(run(nested=True)) == 1.0 and asyncio.run(run(nested=False)) == 1.0
    with pytest.raises(ValueError, match="create_kwargs.ground_truth"):
        asyncio.run(tool.create())


# ---- run_tool_call -------------------------------------------------------------------------------

def test_run_tool_call_passes_a_good_call_through():
    """tool_latency_s is the call's own duration: within the time the test saw pass around it (no fixed bound,
    which a loaded machine could exceed)."""
    async def call():
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await run_tool_call(tool_of(EchoTool), "i", {"text": "hi"}, timeout_s=5)
        return result, loop.time() - started
    (response, reward, metrics, error), elapsed = asyncio.run(call())
    assert (response.text, reward, error) == ("hi", 0.5, None)
    assert metrics["echoed"] == 1 and metrics["tool_error"] == 0 and metrics["tool_timeout"] == 0
    assert 0 <= metrics["tool_latency_s"] <= elapsed


def test_a_raising_tool_costs_one_call_with_its_traceback_logged_once(caplog):
    with caplog.at_level(logging.ERROR, logger="hybridrl.tools.tool_call"):
        response, reward, metrics, error = asyncio.run(run_tool_call(tool_of(RaisingTool, "boom_tool"), "i", {}, 5))
    assert error == "tool 'boom_tool' raised KeyError: 'boom'"
    assert response.text == f"Error: {error}" and reward == 0.0
    assert (metrics["tool_error"], metrics["tool_timeout"]) == (1, 0)
    records = [r for r in caplog.records if r.name == "hybridrl.tools.tool_call"]
    assert len(records) == 1 and records[0].exc_info is not None
    assert "raise KeyError" in caplog.text  # the traceback, once


def test_a_hanging_tool_is_cancelled_at_its_timeout():
    """The tool sleeps an hour: an answer at all means run_tool_call's timeout ended it, and the error, the metrics
    and the tool's own CancelledError say so. Only lower bounds on the time: a loaded machine cannot break them."""
    HangingTool.cancelled = False

    async def call():
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await run_tool_call(tool_of(HangingTool, "slow"), "i", {}, timeout_s=0.3)
        return result, loop.time() - started
    (response, reward, metrics, error), elapsed = asyncio.run(call())
    assert error == "tool 'slow' timed out after 0.3 s" and response.text == f"Error: {error}"
    assert (metrics["tool_error"], metrics["tool_timeout"]) == (1, 1)
    assert HangingTool.cancelled  # cancelled inside its sleep, not finished
    assert elapsed >= 0.3 and metrics["tool_latency_s"] >= 0.3


def test_malformed_return_values_are_errors_and_verl_str_returns_are_accepted():
    _, _, metrics, error = asyncio.run(run_tool_call(tool_of(BadReturnTool), "i", {}, 5))
    assert error.startswith("tool 'echo' raised TypeError: execute returned 'just a string', expected (ToolResponse")
    response, reward, metrics, error = asyncio.run(run_tool_call(tool_of(StrReturnTool), "i", {}, 5))
    assert (response.text, reward, error, metrics["tool_error"]) == ("plain text", 0.0, None, 0)


# ---- tools_kwargs and truncation ---------------------------------------------------------------

def test_tool_phase_kwargs_picks_a_phase_and_refuses_typos():
    tools_kwargs = {"calc": {"create_kwargs": {"ground_truth": "3"}, "calc_reward_kwargs": {"strict": True}}}
    assert tool_phase_kwargs(tools_kwargs, "calc", "create") == {"ground_truth": "3"}
    assert tool_phase_kwargs(tools_kwargs, "calc", "calc_reward") == {"strict": True}
    assert tool_phase_kwargs(tools_kwargs, "calc", "execute") == {}
    assert tool_phase_kwargs(tools_kwargs, "other", "create") == {}
    assert tool_phase_kwargs(None, "calc", "release") == {}
    with pytest.raises(ValueError, match="phase must be one of"):
        tool_phase_kwargs(tools_kwargs, "calc", "creat")
    with pytest.raises(ValueError, match=r"has keys \['create_kwarg'\]"):
        tool_phase_kwargs({"calc": {"create_kwarg": {}}}, "calc", "create")
    check_tools_kwargs(tools_kwargs, ["calc"], where="row 3 extra_info")
    check_tools_kwargs({**tools_kwargs, "code": None}, ["calc"])  # parquet's None for another row's tool
    assert tool_phase_kwargs({"calc": None}, "calc", "create") == {}
    with pytest.raises(ValueError, match=r"row 3 extra_info.tools_kwargs names tool 'calc', not among .*\['other'\]"):
        check_tools_kwargs(tools_kwargs, ["other"], where="row 3 extra_info")
    with pytest.raises(ValueError, match=r"tools_kwargs\['calc'\].create_kwargs must be a mapping"):
        check_tools_kwargs({"calc": {"create_kwargs": "3"}}, ["calc"])


@pytest.mark.parametrize("side, expected", [
    ("left", "abcd...(truncated)"), ("right", "(truncated)...ghij"), ("middle", "ab...(truncated)...ij")])
def test_truncate_text_sides(side, expected):
    assert truncate_text("abcdefghij", 4, side) == expected
    assert truncate_text("abc", 4, side) == "abc"
