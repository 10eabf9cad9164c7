"""Tool-call parsers: the model's text -> the calls it asked for, by `rollout.multi_turn.format`.

A parser never raises on what the model wrote: a call whose JSON does not parse, or that lacks a
name, comes back as a ParsedToolCall with `error` set, so the loop can answer it with a tool error
message (the model learns from it) instead of dropping it or failing the sample.

    hermes (Qwen / NousResearch):  <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>

Register another syntax with `@register_tool_parser("name")` on a function (text) -> (content, calls).

verl's interface over the same parsers, for loops written against it:
`ToolParser.get_tool_parser(format, tokenizer).extract_tool_calls(token_ids)` -> (content, [FunctionCall]), the
calls' arguments as JSON strings; as verl's parsers do, it leaves out the calls that cannot run (logged).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from pydantic import BaseModel

logger = logging.getLogger(__name__)

TOOL_PARSERS: dict[str, Callable[[str], tuple[str, list["ParsedToolCall"]]]] = {}


@dataclass
class ParsedToolCall:
    """One call as the model wrote it. error: why it cannot run (malformed JSON, no name), else None."""
    name: Optional[str]
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


def register_tool_parser(name: str):
    def decorator(parse: Callable[[str], tuple[str, list[ParsedToolCall]]]):
        TOOL_PARSERS[name] = parse
        return parse
    return decorator


def get_tool_parser(name: str) -> Callable[[str], tuple[str, list[ParsedToolCall]]]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format: expected one of {sorted(TOOL_PARSERS)}, "
                         f"got {name!r}")
    return TOOL_PARSERS[name]


class FunctionCall(BaseModel):
    """A call as verl's parsers give it: the tool's name, its arguments as a JSON string and the call's id where the
    syntax writes one (None for hermes and gpt-oss)."""
    name: str
    arguments: str
    tool_call_id: Optional[str] = None


class ToolParser:
    """verl's parser object: one registered syntax bound to the tokenizer that decodes the model's tokens."""

    def __init__(self, parse: Callable[[str], tuple[str, list[ParsedToolCall]]], tokenizer):
        self.parse = parse
        self.tokenizer = tokenizer

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer) -> "ToolParser":
        return cls(get_tool_parser(name), tokenizer)

    @property
    def stop_token_ids(self) -> list[int]:
        """Tokens the engine must stop at for a call to be parsed (verl's): none, the syntaxes here end a call with
        the model's end of turn."""
        return []

    async def extract_tool_calls(self, responses_ids: list[int], tools=None) -> tuple[str, list[FunctionCall]]:
        """(the text without its calls, the well-formed calls in order). tools: verl's parsers may consult the
        schemas; these syntaxes name the tool in the call."""
        content, calls = self.parse(self.tokenizer.decode(responses_ids))
        for call in calls:
            if call.error is not None:
                logger.warning("tool call left out (verl's parsers skip malformed calls): %s", call.error)
        return content, [FunctionCall(name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False))
                         for call in calls if call.error is None]


HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@register_tool_parser("hermes")
def parse_hermes(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(the text without its <tool_call> blocks, the calls in order). Arguments may be a JSON object or a string
    holding one (some models double-encode them)."""
    calls = [_hermes_call(body.strip()) for body in HERMES_CALL.findall(text)]
    return HERMES_CALL.sub("", text), calls


def _hermes_call(body: str) -> ParsedToolCall:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return ParsedToolCall(name=None, error=f"the tool call is not valid JSON ({err.msg} at char {err.pos}): "
                                               f"{body[:200]!r}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ParsedToolCall(name=None, error=f"a tool call must be a JSON object with a string \"name\", got "
                                               f"{body[:200]!r}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ParsedToolCall(name=call["name"], error=f"the \"arguments\" of a call to {call['name']!r} must be a "
                                                       f"JSON object, got {arguments!r}")
    return ParsedToolCall(name=call["name"], arguments=arguments)

