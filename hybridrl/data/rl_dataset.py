"""RL prompt data: parquet in verl's layout (see `rl_parquet.py`) -> left-padded prompt tensors plus metadata.

Every item is a dict of tensors (input_ids, attention_mask, position_ids; all of length
data.max_prompt_length, padded on the LEFT so generation appends on the right) plus every other
column of the row as a plain Python object. `collate_fn` turns a list of items into the dict that
`DataProto.from_single_dict` takes.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler, SequentialSampler

from hybridrl.utils.import_utils import load_extern_object

TRUNCATION_MODES = ("error", "left", "right")
# extra_info entries that verl's dataset lifts into columns of their own: the agent loops read them as keyword
# arguments (tools_kwargs: per-tool create/execute/... arguments; interaction_kwargs: the interaction's name and
# its start arguments).
AGENT_LOOP_KWARGS = ("tools_kwargs", "interaction_kwargs")


class RLHFDataset(Dataset):
    """Prompts from one or more parquet files, chat template applied (with the generation prompt).

    `config` is the `data` config group; the keys read are prompt_key, max_prompt_length,
    truncation (error | left | right), filter_overlong_prompts, return_raw_chat, return_full_prompt,
    apply_chat_template_kwargs (extra arguments of the chat template, e.g. enable_thinking) when the config has
    it, and reward_fn_key when the config has it (then every file must have that column).
    Items also carry `raw_prompt_ids` (the unpadded token ids, for engines that take lists),
    `index` (extra_info["index"] when the row has one, else the row's position in this dataset), and, where verl's
    dataset puts them for agent loops, `tools_kwargs` and `interaction_kwargs` (extra_info's, else {}).

    Rows are kept in file order. filter_overlong_prompts drops the rows whose templated prompt is
    longer than max_prompt_length (and prints how many); then `max_samples` (-1: all; the trainer
    passes data.train_max_samples or data.val_max_samples) keeps the first max_samples rows.
    """

    def __init__(self, data_files: str | Sequence[str], tokenizer, config, max_samples: int = -1):
        self.data_files = [data_files] if isinstance(data_files, str) else list(data_files)
        self.tokenizer = tokenizer
        self.prompt_key = _require(config, "prompt_key")
        self.reward_fn_key = config.get("reward_fn_key")
        self.max_prompt_length = int(_require(config, "max_prompt_length"))
        self.truncation = _require(config, "truncation")
        self.return_raw_chat = bool(_require(config, "return_raw_chat"))
        self.return_full_prompt = bool(_require(config, "return_full_prompt"))
        self.apply_chat_template_kwargs = dict(config.get("apply_chat_template_kwargs") or {})
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {self.truncation!r}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; left padding of prompts needs one")
        if max_samples != -1 and not (isinstance(max_samples, int) and max_samples > 0):
            raise ValueError(f"max_samples (data.train_max_samples / data.val_max_samples) must be -1 (all rows) "
                             f"or a positive int, got {max_samples!r}")
        self.rows, self.row_origins = self._read_rows()
        if bool(_require(config, "filter_overlong_prompts")):
            self._drop_overlong_rows()
        if max_samples != -1 and max_samples < len(self.rows):
            print(f"RLHFDataset: max_samples={max_samples} keeps the first {max_samples} of {len(self.rows)} rows")
            self.rows, self.row_origins = self.rows[:max_samples], self.row_origins[:max_samples]

    def _read_rows(self) -> tuple[list[dict], list[tuple[str, int]]]:
        """All rows of all files, plus (file, row-in-file) per row so errors can name where a row came from."""
        rows, origins = [], []
        for path in self.data_files:
            if not os.path.isfile(path):
                raise FileNotFoundError(f"data file {path} does not exist")
            file_rows = pq.read_table(path).to_pylist()
            for column, key in ((self.prompt_key, "prompt_key"), (self.reward_fn_key, "reward_fn_key")):
                if file_rows and column is not None and column not in file_rows[0]:
                    raise KeyError(f"{path} has no column {column!r} (data.{key}); columns: {sorted(file_rows[0])}")
            rows.extend(file_rows)
            origins.extend((path, row_in_file) for row_in_file in range(len(file_rows)))
        return rows, origins

    def _drop_overlong_rows(self) -> None:
        keep = [i for i in range(len(self.rows)) if len(self._prompt_token_ids(i)) <= self.max_prompt_length]
        print(f"RLHFDataset: filter_overlong_prompts kept {len(keep)} of {len(self.rows)} rows, dropped "
              f"{len(self.rows) - len(keep)} whose prompt is longer than data.max_prompt_length="
              f"{self.max_prompt_length} tokens ({', '.join(self.data_files)})")
        self.rows = [self.rows[i] for i in keep]
        self.row_origins = [self.row_origins[i] for i in keep]

    def __len__(self) -> int:
        return len(self.rows)

    def _where(self, index: int) -> str:
        path, row_in_file = self.row_origins[index]
        return f"{path} row {row_in_file} (dataset index {index})"

    def _chat_text(self, index: int) -> str:
        messages = self.rows[index][self.prompt_key]
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                      for m in messages):
            raise ValueError(f"{self._where(index)}: column {self.prompt_key!r} must be a list of "
                             f"{{'role', 'content'}} messages, got {messages!r}")
        return chat_prompt(self.tokenizer, messages, self.apply_chat_template_kwargs)

    def _prompt_token_ids(self, index: int) -> list[int]:
        return prompt_token_ids(self.tokenizer, [self._chat_text(index)])[0]

    def _fit_length(self, token_ids: list[int], index: int) -> list[int]:
        if len(token_ids) <= self.max_prompt_length:
            return token_ids
        if self.truncation == "left":
            return token_ids[-self.max_prompt_length:]
        if self.truncation == "right":
            return token_ids[:self.max_prompt_length]
        raise ValueError(f"{self._where(index)}: prompt is {len(token_ids)} tokens, longer than "
                         f"data.max_prompt_length={self.max_prompt_length}; set data.truncation=left|right "
                         "or data.filter_overlong_prompts=true")

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.rows[index]
        token_ids = self._fit_length(self._prompt_token_ids(index), index)
        num_pad = self.max_prompt_length - len(token_ids)
        input_ids = torch.tensor([self.tokenizer.pad_token_id] * num_pad + token_ids, dtype=torch.long)
        attention_mask = torch.tensor([0] * num_pad + [1] * len(token_ids), dtype=torch.long)
        item = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        }
        item.update({key: value for key, value in row.items() if key != self.prompt_key})
        item["raw_prompt_ids"] = token_ids
        extra_info = row.get("extra_info") or {}
        item["index"] = extra_info["index"] if extra_info.get("index") is not None else index
        for key in AGENT_LOOP_KWARGS:
            item[key] = extra_info.get(key) or {}
        if self.return_raw_chat:
            item["raw_prompt"] = row[self.prompt_key]
        if self.return_full_prompt:
            item["full_prompts"] = self._chat_text(index)
        return item


def chat_prompt(tokenizer, messages: list[dict], apply_chat_template_kwargs: dict) -> str:
    """The prompt text of one row's messages: the chat template with the generation prompt. The row preflight
    (data/row_checks.py) renders with this too, so what it measures is what the dataset feeds the model."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **apply_chat_template_kwargs)


def prompt_token_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """The token ids of rendered prompts (no special tokens added: the template wrote them), in one batched call."""
    return tokenizer(prompts, add_special_tokens=False)["input_ids"]


def _require(config, key: str):
    """config.<key>, or an error naming data.<key> (an OmegaConf node would silently give None)."""
    value = config.get(key) if hasattr(config, "get") else getattr(config, key, None)
    if value is None:
        raise KeyError(f"data.{key} must be set for RLHFDataset")
    return value


def collate_fn(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack tensors; gather everything else into 1-D numpy object arrays (one entry per sample)."""
    keys = list(items[0])
    for position, item in enumerate(items):
        if list(item) != keys:
            raise ValueError(f"collate_fn: item {position} has keys {sorted(item)}, item 0 has {sorted(keys)}")
    batch: dict[str, Any] = {}
    for key in keys:
        values = [item[key] for item in items]
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        else:
            column = np.empty(len(values), dtype=object)
            for position, value in enumerate(values):  # element-wise: np.array would turn lists into 2-D
                column[position] = value
            batch[key] = column
    return batch


def get_dataset_class(data_config) -> type:
    """The run's dataset class: RLHFDataset, or the user's class named by data.custom_cls.path/name (verl's name).
    Agent loops get it as `dataset_cls`."""
    custom = data_config.custom_cls
    if not custom.path:
        return RLHFDataset
    if not custom.name:
        raise ValueError(f"data.custom_cls.path is {custom.path!r} but data.custom_cls.name is empty")
    dataset_cls = load_extern_object(custom.path, custom.name)
    if not (isinstance(dataset_cls, type) and issubclass(dataset_cls, Dataset)):
        raise TypeError(f"data.custom_cls: {custom.name!r} in {custom.path} must be a subclass of "
                        f"torch.utils.data.Dataset, got {dataset_cls!r}")
    return dataset_cls


def create_rl_dataset(data_files: str | Sequence[str], tokenizer, data_config, max_samples: int) -> Dataset:
    """The run's dataset (get_dataset_class), built as `cls(data_files=..., tokenizer=..., config=data_config,
    max_samples=...)`; a custom class's items must be dicts that `collate_fn` can stack (as RLHFDataset's are)."""
    dataset_cls = get_dataset_class(data_config)
    return dataset_cls(data_files=data_files, tokenizer=tokenizer, config=data_config, max_samples=max_samples)


def create_rl_sampler(dataset: Dataset, shuffle: bool, seed: int):
    """A seeded shuffle (its generator's state is `sampler.generator.get_state()`, for resuming) or the file order."""
    if shuffle:
        return RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    return SequentialSampler(dataset)


def make_dataloader(dataset: Dataset, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
                    num_workers: int = 0) -> DataLoader:
    """A deterministic DataLoader: the same seed gives the same batches in the same order, with or without
    `num_workers` (data.dataloader_num_workers) worker processes: the sampler, and so the order, stays in this
    process; the workers only tokenise and collate.

    Workers are spawned, never forked. This process runs Ray (the trainer's actor, or a driver), and a fork copies
    Ray's gRPC threads mid-call: Ray's data-loading guide asks for spawn or forkserver (ray-project/ray#52924). The
    test suite's driver stopped hearing its actors' state right after such a fork, and every later test hung (CI and
    a local rerun, 2026-11-27). They receive the dataset by value (`_ByValue`) and start at each pass over the data
    (an epoch, a validation): about 1.4 s for two, where persistent workers would hold a process per worker and
    loader all run.
    """
    spawned = num_workers > 0
    return DataLoader(_ByValue(dataset) if spawned else dataset, batch_size=batch_size,
                      sampler=create_rl_sampler(dataset, shuffle, seed), collate_fn=collate_fn, drop_last=drop_last,
                      num_workers=num_workers, multiprocessing_context="spawn" if spawned else None)


class _ByValue(Dataset):
    """A dataset that a spawned worker receives pickled by value (cloudpickle), class included: a data.custom_cls
    class comes from a user's file that load_extern_object keeps out of sys.modules, where plain pickle would look
    for it. The worker gets the dataset itself; here, attribute reads pass through to it."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getattr__(self, name: str):  # only for names the wrapper itself lacks
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __reduce__(self):
        from ray import cloudpickle

        return cloudpickle.loads, (cloudpickle.dumps(self.dataset),)
