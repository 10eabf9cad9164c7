"""gpt-oss's tool calls (OpenAI's harmony format): the parser of `multi_turn.format=gpt-oss` and the tool-response
text that verl's loops append by hand for it (its chat template renders a tool message only after the assistant
message that called it, so the usual template delta cannot be cut from a dummy turn).

    call:      [<|start|>assistant]<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
    response:  <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>TEXT<|end|>   (one per call)
               then <|start|>assistant, the next generation prompt

Reasoning (the analysis channel) may mention calls; it is cut before calls are looked for.
"""
from __future__ import annotations

import json
import re
from typing import Any

from hybridrl.agent_loop.tool_parser import ParsedToolCall, register_tool_parser

ANALYSIS = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>analysis<\|message\|>.*?<\|end\|>", re.DOTALL)
CALL = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>[^<]* to=functions\.([^<\s]+) ?<\|constrain\|>json"
                  r"<\|message\|>(.*?)<\|call\|>", re.DOTALL)


@register_tool_parser("gpt-oss")
def parse_gpt_oss(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(the text without its reasoning and calls, the calls in order); a call whose arguments are not a JSON object
    comes back with `error` set."""
    text = ANALYSIS.sub("", text)
    calls = [_call(name, arguments) for name, arguments in CALL.findall(text)]
    return CALL.sub("", text), calls


def _call(name: str, arguments: str) -> ParsedToolCall:
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as err:
        return ParsedToolCall(name=name, error=f"the arguments of a call to {name!r} are not valid JSON ({err.msg} "
                                               f"at char {err.pos}): {arguments[:200]!r}")
    if not isinstance(parsed, dict):
        return ParsedToolCall(name=name, error=f"the arguments of a call to {name!r} must be a JSON object, got "
                                               f"{arguments[:200]!r}")
    return ParsedToolCall(name=name, arguments=parsed)


def format_gpt_oss_tool_response_manually(tool_response: str, tool_call_name: str) -> str:
    """One tool message as gpt-oss reads it (verl's name)."""
    return f"<|start|>functions.{tool_call_name} to=assistant<|channel|>commentary<|message|>{tool_response}<|end|>"


def add_generation_prompt_for_gpt_oss(message_content: str) -> str:
    """The text followed by gpt-oss's generation prompt (verl's name)."""
    return message_content + "<|start|>assistant"


def build_gpt_oss_tool_response_text(messages: list[dict[str, Any]], tool_call_names: list[str]) -> str:
    """The tool messages (one per call, in order; their `content` text) and the next generation prompt (verl's)."""
    if len(messages) != len(tool_call_names):
        raise ValueError(f"build_gpt_oss_tool_response_text: {len(messages)} tool messages for "
                         f"{len(tool_call_names)} call names")
    return add_generation_prompt_for_gpt_oss("".join(
        format_gpt_oss_tool_response_manually(message["content"], name)
        for message, name in zip(messages, tool_call_names)))
