"""The policy's tokenizer, built the same way wherever a process needs one (controller, actor, reward model)."""
from __future__ import annotations

from typing import Optional

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str, *, trust_remote_code: bool = False,
                   custom_chat_template: Optional[str] = None) -> PreTrainedTokenizerBase:
    """The tokenizer at `path`; with `custom_chat_template` (`actor_rollout_ref.model.custom_chat_template`, a
    Jinja template) that template replaces the tokenizer's own, so prompts, checkpoints and the reward model's
    comparison all see the template the run trains with."""
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if custom_chat_template is not None:
        tokenizer.chat_template = custom_chat_template
    return tokenizer


def policy_tokenizer(config) -> PreTrainedTokenizerBase:
    """The run's policy tokenizer from the run config (data.tokenizer, else the model's own; with
    actor_rollout_ref.model.custom_chat_template): the one the trainer's dataset and every agent-loop worker use, so
    sync and async modes render prompts and turns with the same template."""
    model = config.actor_rollout_ref.model
    return load_tokenizer(config.data.tokenizer or model.path, trust_remote_code=model.trust_remote_code,
                          custom_chat_template=model.custom_chat_template)
