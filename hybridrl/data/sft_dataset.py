"""SFT data: multi-turn chat parquet -> token ids with labels on the assistant turns only.

One row holds a list of chat messages ({"role", "content"}) under `messages_key`. The whole
conversation is rendered once with the tokenizer's chat template and tokenized once; the labels
are the input ids on the tokens the model must produce itself, and -100 (HF's "ignore") elsewhere.

Which tokens the model "produces": for each assistant turn, the text between the end of the
generation prompt (the template rendered up to that turn with `add_generation_prompt=True`, e.g.
"<|im_start|>assistant\\n") and the end of the turn, cut after its EOS token when the template adds
anything after EOS (ChatML's trailing "\\n"): generation stops at EOS, so nothing after it is ever
sampled and nothing after it is trained. System and user turns and the role headers are context only.

Finding the spans on the rendered *text* (every rendered prefix must be a prefix of the whole) and
then mapping characters to tokens with the tokenizer's offsets keeps the one real tokenization of
the conversation; tokenizing turn by turn could differ from it where BPE merges across a boundary.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100
TRUNCATION_MODES = ("error", "left", "right")


class SFTDataset(Dataset):
    """Rows of one or more parquet files, each a conversation; items are unpadded 1-D tensors.

    max_length and truncation (error | left | right) apply to the whole tokenized conversation:
    `error` names the file and row that is too long; `left` keeps the last max_length tokens,
    `right` the first. A row left with no assistant token (none to begin with, or all cut away) is
    an error naming the row, never silently skipped: it would train nothing.
    """

    def __init__(self, data_files: str | Sequence[str], tokenizer, messages_key: str, max_length: int,
                 truncation: str):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
        if max_length <= 0:
            raise ValueError(f"data.max_length must be > 0, got {max_length}")
        if not tokenizer.is_fast:
            raise ValueError(f"the tokenizer must be a fast tokenizer (character offsets are needed), got "
                             f"{type(tokenizer).__name__}")
        if tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer of {tokenizer.name_or_path!r} has no chat template")
        self.tokenizer = tokenizer
        self.messages_key = messages_key
        self.max_length = max_length
        self.truncation = truncation
        self.items = [self._tokenize(messages, where)
                      for messages, where in _read_conversations(data_files, messages_key)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids, labels = self.items[index]
        return {"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels)}

    def _tokenize(self, messages: list[dict], where: str) -> tuple[list[int], list[int]]:
        text, spans = assistant_char_spans(self.tokenizer, messages, where)
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = encoding["input_ids"]
        labels = [token if _starts_inside(start, spans) else IGNORE_INDEX
                  for token, (start, _end) in zip(input_ids, encoding["offset_mapping"])]
        labels = _cut_after_eos(input_ids, labels, self.tokenizer.eos_token_id)
        if len(input_ids) > self.max_length:
            if self.truncation == "error":
                raise ValueError(f"{where}: {len(input_ids)} tokens, longer than data.max_length={self.max_length} "
                                 f"(raise data.max_length or set data.truncation=left|right)")
            keep = slice(-self.max_length, None) if self.truncation == "left" else slice(0, self.max_length)
            input_ids, labels = input_ids[keep], labels[keep]
        if all(label == IGNORE_INDEX for label in labels):
            raise ValueError(f"{where}: no assistant token to train on"
                             + (f" after truncation={self.truncation} to data.max_length={self.max_length}"
                                if len(encoding["input_ids"]) > self.max_length else
                                " (the conversation has no non-empty assistant turn)"))
        return input_ids, labels


def assistant_char_spans(tokenizer, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character span of each assistant turn's own text."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_rendered_prefix(tokenizer, messages[:turn], text, where, add_generation_prompt=True))
        end = len(_rendered_prefix(tokenizer, messages[:turn + 1], text, where, add_generation_prompt=False))
        spans.append((start, end))
    return text, spans


def _rendered_prefix(tokenizer, messages: list[dict], full_text: str, where: str, add_generation_prompt: bool) -> str:
    prefix = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not full_text.startswith(prefix):
        raise ValueError(f"{where}: the chat template renders the first {len(messages)} message(s) as {prefix!r}, "
                         f"which is not a prefix of the whole conversation; assistant turns cannot be located")
    return prefix


def _starts_inside(char_start: int, spans: list[tuple[int, int]]) -> bool:
    return any(start <= char_start < end for start, end in spans)


def _cut_after_eos(input_ids: list[int], labels: list[int], eos_token_id: int | None) -> list[int]:
    """Unlabel the tokens of each labelled run that follow its last EOS (template padding after EOS)."""
    if eos_token_id is None:
        return labels
    labels = list(labels)
    position = 0
    while position < len(labels):
        if labels[position] == IGNORE_INDEX:
            position += 1
            continue
        run_end = position
        while run_end < len(labels) and labels[run_end] != IGNORE_INDEX:
            run_end += 1
        eos_positions = [p for p in range(position, run_end) if input_ids[p] == eos_token_id]
        if eos_positions:
            for p in range(eos_positions[-1] + 1, run_end):
                labels[p] = IGNORE_INDEX
        position = run_end
    return labels


def _read_conversations(data_files: str | Sequence[str], messages_key: str):
    """Yield (messages, "file row N") for every row, checking the message layout as it goes."""
    for path in [data_files] if isinstance(data_files, str) else list(data_files):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"SFT data file {path} does not exist")
        table = pq.read_table(path)
        if messages_key not in table.column_names:
            raise KeyError(f"{path} has no column {messages_key!r} (data.multiturn.messages_key); "
                           f"columns: {table.column_names}")
        for row, messages in enumerate(table.column(messages_key).to_pylist()):
            where = f"{path} row {row}"
            if not isinstance(messages, list) or not messages or not all(_is_message(m) for m in messages):
                raise ValueError(f"{where}: {messages_key!r} must be a non-empty list of messages with string "
                                 f"'role' and 'content', got {messages!r}")
            yield [{"role": m["role"], "content": m["content"]} for m in messages], where


def _is_message(message) -> bool:
    # parquet gives every message struct the union of all rows' fields, so a missing one reads as None
    return isinstance(message, dict) and isinstance(message.get("role"), str) and isinstance(message.get("content"), str)


def collate_right_padded(items: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Pad a list of items on the right to the longest: input_ids, attention_mask, position_ids, labels."""
    length = max(len(item["input_ids"]) for item in items)
    batch = {
        "input_ids": torch.full((len(items), length), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(items), length), dtype=torch.long),
        "labels": torch.full((len(items), length), IGNORE_INDEX, dtype=torch.long),
    }
    for row, item in enumerate(items):
        size = len(item["input_ids"])
        batch["input_ids"][row, :size] = item["input_ids"]
        batch["attention_mask"][row, :size] = 1
        batch["labels"][row, :size] = item["labels"]
    batch["position_ids"] = torch.arange(length).expand(len(items), length).clone()
    return batch
