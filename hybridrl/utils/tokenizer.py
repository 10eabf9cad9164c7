"""The policy's tokenizer: resolved once by the process that controls a run and handed, as an object, to every
process that needs it (worker groups, agent-loop workers, the checkpoint writer), so that none of them derives
its own from the config and all of them hold exactly the tokenizer the prompts were rendered with.

    PPO  RayPPOTrainer.__init__ -> policy_tokenizer(config) -> actor/rollout/ref workers (the checkpoints' tokenizer),
                                                               reward model (the policy's ids it reads), agent loops
    SFT  main_sft.run_sft -> load_tokenizer(model.partial_pretrain) -> every rank

A tokenizer pickles with its vocabulary and chat template, which Ray and the SFT launcher ship with each process's
init arguments, once per process: 5.7 kB for the tiny test tokenizers; Qwen's (151,669 entries) 9.8 MiB, unpickled in
1.1 s where from_pretrained takes 2.2 s (measured on the 2-core CPU machine, 2026-11-28).
"""
from __future__ import annotations

from typing import Optional

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str, *, trust_remote_code: bool = False,
                   custom_chat_template: Optional[str] = None) -> PreTrainedTokenizerBase:
    """The tokenizer at `path`; with `custom_chat_template` (a Jinja template) that template replaces the
    tokenizer's own."""
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if custom_chat_template is not None:
        tokenizer.chat_template = custom_chat_template
    return tokenizer


def policy_tokenizer(config) -> PreTrainedTokenizerBase:
    """The run's policy tokenizer from the PPO config: data.tokenizer, else the policy's own
    (actor_rollout_ref.model.path), with actor_rollout_ref.model.custom_chat_template when set, padding on the
    left (generation continues the prompt's last token). The controller calls this once per run."""
    model = config.actor_rollout_ref.model
    tokenizer = load_tokenizer(config.data.tokenizer or model.path, trust_remote_code=model.trust_remote_code,
                               custom_chat_template=model.custom_chat_template)
    tokenizer.padding_side = "left"
    return tokenizer
