"""A conversation's tokens kept as the model generated them, other messages appended as the chat template renders them
(verl's "Continuous Token", the tokenization verl 0.9's loops use through AgentLoopBase.ct_*).

    initial   = template(messages, tools, generation prompt)
    assistant = runtime + the generated ids                                    (mask 1, the engine's log-probs)
    context   = runtime + template delta of the appended tool / user messages  (mask 0, log-prob 0)

The context delta is what the template adds after a finished assistant turn (from just after its EOS, so the
template's separator after EOS, e.g. a newline, comes with it) up to and including the next generation prompt: the
same delta hybridrl's tool_agent appends (base.template_delta_ids). hybridrl has one such builder for every model
family; verl's per-family builders (Qwen, GLM, gpt-oss, ...) differ only in where these boundary tokens go.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from hybridrl.agent_loop.chat_render import render_ids, template_delta_ids


@dataclass(frozen=True)
class MergeResult:
    """The runtime ids after a merge, and how they changed (verl's record): `appended_token_count` new ids of `kind`
    at the end, after `inserted_token_ids` (none here) and once `removed_prefix_token_count` ids were cut (none)."""
    token_ids: list[int]
    appended_token_count: int
    kind: Literal["assistant", "context"] = "context"
    inserted_token_ids: list[int] = field(default_factory=list)
    removed_prefix_token_count: int = 0


class ContinuousTokenBuilder:
    """Builds and extends one conversation's runtime ids (see the module docstring)."""

    def __init__(self, tokenizer, chat_template_kwargs: Optional[dict[str, Any]] = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def build_initial_tokens(self, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
        return render_ids(self.tokenizer, list(messages), tools=tools or None, add_generation_prompt=True,
                          **self.chat_template_kwargs)

    def merge_assistant_tokens(self, runtime_ids: list[int], assistant_ids: list[int]) -> MergeResult:
        return MergeResult(list(runtime_ids) + list(assistant_ids), len(assistant_ids), kind="assistant")

    def merge_context_tokens(self, previous_messages: list[dict], updated_messages: list[dict],
                             runtime_ids: list[int], tools: Optional[list[dict]] = None) -> MergeResult:
        """Append the messages `updated_messages` adds to `previous_messages` (append-only: the earlier ones are
        the conversation's, unchanged; an appended assistant message must be followed by another message)."""
        if updated_messages[:len(previous_messages)] != list(previous_messages):
            raise ValueError("continuous token: updated_messages must start with previous_messages unchanged "
                             "(messages are only appended)")
        appended = list(updated_messages[len(previous_messages):])
        if appended and appended[-1].get("role") == "assistant":
            raise ValueError("continuous token: appended context messages cannot end with an assistant message "
                             "(the model writes the assistant turns)")
        delta = template_delta_ids(self.tokenizer, appended, tools=tools or None,
                                   **self.chat_template_kwargs) if appended else []
        return MergeResult(list(runtime_ids) + delta, len(delta), kind="context")

    @staticmethod
    def align_response_metadata(merge: MergeResult, response_mask: list[int],
                                response_logprobs: Optional[list[float]] = None,
                                assistant_logprobs: Optional[list[float]] = None
                                ) -> tuple[list[int], Optional[list[float]]]:
        """The response mask and log-probs extended by the merge: 1 and the engine's log-probs on assistant ids,
        0 and 0.0 on context ids."""
        if response_logprobs is None and assistant_logprobs is not None:
            raise ValueError("continuous token: assistant_logprobs given without the response_logprobs they extend")
        added = merge.appended_token_count
        if merge.kind == "assistant":
            mask = list(response_mask) + [1] * added
            if response_logprobs is None:
                return mask, None
            new_logprobs = list(assistant_logprobs or [])
            if len(new_logprobs) != added:
                raise ValueError(f"continuous token: {len(new_logprobs)} assistant log-probs for {added} generated ids")
            return mask, list(response_logprobs) + new_logprobs
        mask = list(response_mask) + [0] * added
        return mask, None if response_logprobs is None else list(response_logprobs) + [0.0] * added
