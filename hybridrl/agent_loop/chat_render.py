"""Token ids of chat-template renderings, as the agent loops append them turn by turn.

The dataset tokenizes a prompt as the template's text tokenized without special tokens; every rendering here does
the same, so a loop's ids and the dataset's agree. A model's turn ends at its EOS token (the engine stops there);
what a template puts after EOS (a newline, say) belongs to the next message's ids.
"""
from __future__ import annotations

from typing import Any, Optional

# What an appended message's ids are cut from: a finished assistant turn (no system message, so templates that add a
# default system prompt add it here too, and it is cut off with the rest).
DUMMY_TURN = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}]


def render_ids(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """The token ids of the chat template's text for `messages` (the text tokenized without special tokens, as the
    dataset tokenizes prompts, so both give the same ids)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def system_prompt_ids(tokenizer, template_kwargs: dict[str, Any]) -> list[int]:
    """The ids the chat template puts before a conversation's first message (a default system prompt, or []):
    what one user message adds beyond the ids of two user messages minus one (verl's initialize_system_prompt)."""
    one = render_ids(tokenizer, [{"role": "user", "content": ""}], add_generation_prompt=False, **template_kwargs)
    two = render_ids(tokenizer, [{"role": "user", "content": ""}] * 2, add_generation_prompt=False,
                     **template_kwargs)
    return one[:len(one) - (len(two) - len(one))]


def end_of_last_turn(tokenizer, text: str) -> int:
    """Where the model's part of the last turn of `text` ends: after its EOS token's text (the whole text when the
    template does not write EOS)."""
    eos_text = tokenizer.eos_token or ""
    position = text.rfind(eos_text) if eos_text else -1
    return len(text) if position < 0 else position + len(eos_text)


def template_delta_ids(tokenizer, appended: list[dict], tools: Optional[list[dict]] = None,
                       **template_kwargs) -> list[int]:
    """The ids the template adds for `appended` (tool or user messages) after a finished assistant turn, from just
    after its EOS up to and including the next generation prompt (verl's incremental delta)."""
    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_kwargs)
    prefix = render(DUMMY_TURN, add_generation_prompt=False)
    full = render(DUMMY_TURN + list(appended), add_generation_prompt=True)
    end_of_dummy = end_of_last_turn(tokenizer, prefix)
    if full[:end_of_dummy] != prefix[:end_of_dummy]:
        raise ValueError("the chat template renders earlier messages differently once tool or user messages follow; "
                         "their tokens cannot be appended incrementally")
    return tokenizer(full[end_of_dummy:], add_special_tokens=False)["input_ids"]


def turn_separator_ids(tokenizer, template_kwargs: dict[str, Any]) -> list[int]:
    """The ids the template puts after a turn's EOS, before the next turn (e.g. a newline; [] when none): what a
    turn rendered on its own, and the model stopping at EOS, both leave out (verl's initialize_turn_separator)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                         add_generation_prompt=False, **template_kwargs)
    rest = text[end_of_last_turn(tokenizer, text):]
    return tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
