"""Validation: the plain validation set (`data.val_files`, sampled with `rollout.val_kwargs`) and named eval sets
(`data.eval_sets`), each with its own sampling settings, logged in verl's and slime's metric layouts.

An eval set (slime's `--eval-prompt-data name path` with its `--n-samples-per-eval-prompt`, `--eval-temperature`,
`--eval-top-p`, `--eval-top-k`, `--eval-max-response-len`; verl's val_kwargs per set) is one entry of
`data.eval_sets`:

    {name: aime, path: /data/aime.parquet (or a list of files), n_samples_per_prompt: 16, temperature: 0.6,
     top_p: 0.95, top_k: -1, do_sample: true, max_response_length: 4096, max_samples: -1}

where only name and path are required; a setting left out is `rollout.val_kwargs`'s (n, temperature, top_p, top_k,
do_sample), max_response_length defaults to rollout.response_length (it may only be shorter: responses keep the
rollout's padded layout) and max_samples to -1 (every row).

Metrics, after each validation:
  verl   val-core/<data_source>/reward/mean@<n>   every validated response of that data source sampled n times per
                                                  prompt (plain set and eval sets pooled), val-aux/<extra>/mean@<n>,
                                                  val-aux/reward/errors (summed)
  slime  eval/<name>                              the set's mean reward
         eval/<name>-truncated_ratio              share of its responses cut at its max_response_length (no EOS)
         eval/<name>/response_len/mean, /max      generated tokens per response
         eval/<name>/<extra>                      the mean of each numeric reward extra (e.g. acc) over its responses:
                                                  val-aux/ pools the sets, this tells them apart
With no eval set the metrics are exactly those of the plain set, as before eval sets existed.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from hybridrl.data.sample import groups_to_batch, sampled
from hybridrl.trainer.ppo.generation_dump import decode_generations
from hybridrl.trainer.ppo.metric_utils import compute_validation_metrics

EVAL_SET_KEYS = ("name", "path", "n_samples_per_prompt", "temperature", "top_p", "top_k", "do_sample",
                 "max_response_length", "max_samples")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.\-]+$")  # it becomes part of metric keys


@dataclass(frozen=True)
class EvalSet:
    """One named eval set with every setting resolved (see the module docstring)."""
    name: str
    files: tuple[str, ...]
    n: int
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    max_response_length: int
    max_samples: int

    def sampling_overrides(self) -> dict[str, Any]:
        """What the engines read from meta_info["sampling_overrides"] (workers/rollout/sampling.py)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_tokens": self.max_response_length}


# ---------------------------------------------------------------------- config

def eval_set_problems(entries: list, response_length: int) -> list[str]:
    """One line per problem with `data.eval_sets` (trainer/config_checks.py reports them with the rest)."""
    problems, names = [], set()
    for index, entry in enumerate(entries):
        key = f"data.eval_sets[{index}]"
        if not isinstance(entry, dict):
            problems.append(f"{key}: expected a mapping with name and path, got {entry!r}")
            continue
        unknown = sorted(set(entry) - set(EVAL_SET_KEYS))
        if unknown:
            problems.append(f"{key}: expected keys among {list(EVAL_SET_KEYS)}, got unknown {unknown}")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            problems.append(f"{key}.name: expected a name of letters, digits, '_', '.', '-', got {name!r}")
        elif name in names:
            problems.append(f"{key}.name: expected a name no other eval set has, got {name!r} twice")
        names.add(name)
        path = entry.get("path")
        if not (isinstance(path, str) or (isinstance(path, list) and path and all(isinstance(p, str) for p in path))):
            problems.append(f"{key}.path: expected a .parquet file or a list of them, got {path!r}")
        problems += _setting_problems(key, entry, response_length)
    return problems


def _setting_problems(key: str, entry: dict, response_length: int) -> list[str]:
    rules = {  # key -> (accepted, expected in words)
        "n_samples_per_prompt": (lambda v: _is_int(v) and v > 0, "an integer > 0"),
        "temperature": (lambda v: _is_number(v) and v >= 0, "a number >= 0"),
        "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "top_k": (lambda v: _is_int(v) and (v == -1 or v > 0), "-1 (off) or an integer > 0"),
        "do_sample": (lambda v: isinstance(v, bool), "true or false"),
        "max_response_length": (lambda v: _is_int(v) and 0 < v <= response_length,
                                f"an integer in [1, actor_rollout_ref.rollout.response_length={response_length}]"),
        "max_samples": (lambda v: _is_int(v) and (v == -1 or v > 0), "-1 (every row) or an integer > 0"),
    }
    return [f"{key}.{name}: expected {words}, got {entry[name]!r}" for name, (accepted, words) in rules.items()
            if name in entry and not accepted(entry[name])]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def eval_sets_from_config(config) -> list[EvalSet]:
    """The configured eval sets, defaults filled in from rollout.val_kwargs and rollout.response_length."""
    rollout = config.actor_rollout_ref.rollout
    defaults = rollout.val_kwargs
    sets = []
    for entry in config.data.eval_sets:
        path = entry["path"]
        sets.append(EvalSet(
            name=entry["name"], files=tuple([path] if isinstance(path, str) else path),
            n=entry.get("n_samples_per_prompt", defaults.n), do_sample=entry.get("do_sample", defaults.do_sample),
            temperature=float(entry.get("temperature", defaults.temperature)),
            top_p=float(entry.get("top_p", defaults.top_p)), top_k=int(entry.get("top_k", defaults.top_k)),
            max_response_length=entry.get("max_response_length", rollout.response_length),
            max_samples=entry.get("max_samples", -1)))
    return sets


# ---------------------------------------------------------------------- metrics

def truncated_responses(batch, max_response_length: int, eos_token_id: Optional[int]) -> torch.Tensor:
    """Per row: the response reached max_response_length tokens and its last one is not the EOS."""
    response_width = batch.batch["responses"].shape[1]
    lengths = batch.batch["attention_mask"][:, -response_width:].sum(-1)
    last = batch.batch["responses"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lengths >= max_response_length) & (last != eos_token_id)


def eval_set_metrics(name: str, rewards: torch.Tensor, truncated: torch.Tensor, lengths: torch.Tensor,
                     extra: Optional[dict[str, list]] = None) -> dict[str, float]:
    """slime's layout for one eval set, and its reward extras (see the module docstring)."""
    lengths = lengths.float()
    metrics = {f"eval/{name}": rewards.float().mean().item(),
               f"eval/{name}-truncated_ratio": truncated.float().mean().item(),
               f"eval/{name}/response_len/mean": lengths.mean().item(),
               f"eval/{name}/response_len/max": lengths.max().item()}
    for key, values in (extra or {}).items():
        if values and all(isinstance(v, (int, float, bool, np.number)) for v in values):
            metrics[f"eval/{name}/{key}"] = float(np.mean(values))
    return metrics


class ValidationResults:
    """Collects every scored validation batch, then gives all metrics at once (`metrics`) and the generations
    for dumps and trackers (`samples`)."""

    def __init__(self, tokenizer, reward_fn_key: str):
        self.tokenizer, self.reward_fn_key = tokenizer, reward_fn_key
        self.samples: list[tuple[str, str, float]] = []
        self._by_n: dict[int, dict[str, list]] = defaultdict(lambda: {"sources": [], "scores": [], "extra": {}})
        self._reward_metrics: dict[str, float] = {}
        self._per_set: dict[EvalSet, dict[str, list]] = {}

    def add_groups(self, groups: list, reward_metrics: dict[str, float], n: int, eval_set: Optional[EvalSet], *,
                   prompt_length: int, response_length: int, pad_token_id: int) -> None:
        """Scored groups of the sample-group flow (each `n` samples of one prompt) and the reward metrics of scoring
        them, added as one batch with the scorer's extras of each sample."""
        batch = groups_to_batch(groups, prompt_length=prompt_length, response_length=response_length,
                                pad_token_id=pad_token_id, with_log_probs=False, scored=True)
        extras = [sample.metadata.get("reward_extra_info") or {} for group in groups for sample in sampled(group)]
        reward = {"reward_tensor": batch.batch["token_level_scores"], "reward_metrics": reward_metrics,
                  "reward_extra_info": {key: [extra.get(key) for extra in extras]
                                        for key in sorted({key for extra in extras for key in extra})}}
        self.add(batch, reward, n=n, eval_set=eval_set)

    def add(self, batch, reward: dict, n: int, eval_set: Optional[EvalSet] = None) -> None:
        """One scored batch (`reward`: the reward manager's dict) generated with n responses per prompt."""
        for key, value in reward.get("reward_metrics", {}).items():  # counts (reward/errors): summed
            self._reward_metrics[f"val-aux/{key}"] = self._reward_metrics.get(f"val-aux/{key}", 0.0) + value
        scores = reward["reward_tensor"].sum(-1)
        group = self._by_n[n]
        group["scores"].append(scores)
        self.samples.extend(decode_generations(self.tokenizer, batch, scores))
        group["sources"].append(batch.non_tensor_batch[self.reward_fn_key])
        extra = {key: [value for value in values if value is not None]  # None: the sample's scorer failed
                 for key, values in reward.get("reward_extra_info", {}).items()}
        for key, values in extra.items():
            group["extra"].setdefault(key, []).extend(values)
        if eval_set is not None:
            collected = self._per_set.setdefault(eval_set, {"rewards": [], "truncated": [], "lengths": [],
                                                            "extra": {}})
            collected["rewards"].append(scores)
            for key, values in extra.items():
                collected["extra"].setdefault(key, []).extend(values)
            collected["truncated"].append(truncated_responses(batch, eval_set.max_response_length,
                                                              self.tokenizer.eos_token_id))
            width = batch.batch["responses"].shape[1]
            collected["lengths"].append(batch.batch["attention_mask"][:, -width:].sum(-1))

    def metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for n, group in self._by_n.items():
            metrics.update(compute_validation_metrics(np.concatenate(group["sources"]), torch.cat(group["scores"]),
                                                      n=n, extra=group["extra"]))
        metrics.update(self._reward_metrics)
        for eval_set, collected in self._per_set.items():
            metrics.update(eval_set_metrics(eval_set.name, torch.cat(collected["rewards"]),
                                            torch.cat(collected["truncated"]), torch.cat(collected["lengths"]),
                                            collected["extra"]))
        return metrics
