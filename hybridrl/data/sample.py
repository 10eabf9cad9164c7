"""Sample records: one response to one prompt, kept as token lists until a training batch is assembled.

slime's data flow (README, "Sample buffer, dynamic sampling, partial rollout") keeps samples as records between
steps: a group whose generation was aborted waits in the buffer with the tokens it has so far, a completed group
carries its reward, and a filter looks at whole groups. Only when the trainer takes a batch do the groups become a
padded DataProto, in one function, `groups_to_batch` (padding itself is batch_layout.to_batch_layout's).

A group is `list[Sample]`: the `rollout.n` samples of one prompt, sharing `group_index`. With ReMax
(algorithm.adv_estimator=remax) a group has one more sample, last: its prompt's greedy baseline (`is_baseline`),
generated with the group, in the same agent-loop worker call, so from the same weights (greedy sampling parameters:
GroupRollout.submit). It is scored with the group and aborted, buffered, continued or reset with it; its score becomes
the `reward_baselines` of the group's rows when `groups_to_batch` assembles the batch, and it is never a row of the
batch. `sampled(group)` is what the filters judge and what is trained; `baseline_of(group)` the baseline (None without).

Every response token carries the policy version of the weights that generated it (`token_versions`), as the engine
server reported it with the tokens (TokenOutput.weight_version; the definition: data/batch_layout.py).
A sample continued after an abort has tokens of two or more versions; the trainer sees them as the
`response_weight_versions` column (the one the agent loops fill too) and the metrics `data_flow/partial_ratio` and
`data_flow/staleness/*`, computed from that column.

Records hold only plain Python values (lists, dicts, numbers, strings), so a checkpoint can save them with
`torch.save` and load them back with `weights_only=True`, bit for bit.
"""
from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from hybridrl.protocol import DataProto
from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY, last_one, spans_versions, staleness, to_batch_layout

PENDING, COMPLETED, TRUNCATED, ABORTED = "pending", "completed", "truncated", "aborted"
STATUSES = (PENDING, COMPLETED, TRUNCATED, ABORTED)


@dataclass
class Sample:
    """One prompt's response as it is generated, scored, maybe aborted and continued.

    status: pending (nothing generated yet), completed (ended on EOS), truncated (reached the length budget),
    aborted (generation was stopped midway: `response_ids` holds the tokens so far; partial rollout continues it;
    a multi-turn loop that can resume also keeps its conversation's state in `resume_state`).
    reward: a number, or a dict from which `reward_key` picks the number the estimators use (None: not scored).
    metadata: the dataset row's columns (data_source, reward_model, extra_info, raw_prompt, ...), which the reward
    manager and the agent loops read; a hook may add its own keys, an agent loop its extra_fields.
    """
    group_index: int
    index: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: Optional[list[float]] = None
    token_versions: list[int] = field(default_factory=list)
    reward: Optional[Any] = None
    reward_key: Optional[str] = None
    status: str = PENDING
    num_aborts: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    num_turns: int = 0  # an agent loop's turns (its AgentLoopOutput.num_turns); 0: generated without a loop
    agent_metrics: Optional[dict[str, Any]] = None  # an agent loop's AgentLoopMetrics, as a dict
    error: Optional[str] = None  # an agent loop's traceback when it failed: then no loss on the sample, reward 0
    resume_state: Optional[dict[str, Any]] = None  # an aborted resumable loop's state (AgentLoopOutput.resume_state)
    is_baseline: bool = False  # ReMax's greedy baseline of its group: scored, never trained (module docstring)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def tokens(self) -> list[int]:
        """Prompt and response so far: what a continued generation is conditioned on."""
        return self.prompt_ids + self.response_ids

    def reward_value(self) -> float:
        """The number the estimators use: `reward`, or `reward[reward_key]` for a dict reward."""
        if self.reward is None:
            raise ValueError(f"sample {self.index} (group {self.group_index}) has no reward yet")
        if isinstance(self.reward, dict):
            if self.reward_key not in self.reward:
                raise KeyError(f"sample {self.index}: reward is a dict {sorted(self.reward)} and reward_key "
                               f"{self.reward_key!r} is not one of its keys (set data_flow.reward_key)")
            return float(self.reward[self.reward_key])
        return float(self.reward)

    def append(self, token_ids: list[int], log_probs: Optional[list[float]], version: int, trainable: bool = True):
        """Add generated (or, trainable=False, inserted) tokens produced under policy `version`."""
        self.response_ids += list(token_ids)
        self.loss_mask += [1 if trainable else 0] * len(token_ids)
        self.token_versions += [version] * len(token_ids)
        if log_probs is not None or self.rollout_log_probs is not None:
            if log_probs is None or (self.rollout_log_probs is None and len(self.response_ids) > len(token_ids)):
                raise ValueError(f"sample {self.index}: log-probs given for some generate calls but not all")
            self.rollout_log_probs = (self.rollout_log_probs or []) + [float(x) for x in log_probs]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> Sample:
        return cls(**state)


def to_plain(value: Any) -> Any:
    """A dataset value as plain Python (numpy arrays and scalars, tensors become lists and numbers)."""
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(item) for item in value]
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return to_plain(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    return value


def new_group(row: dict[str, Any], n: int, group_index: int, first_index: int,
              baseline: bool = False) -> list[Sample]:
    """`n` pending samples of one dataset row (its `raw_prompt_ids` is the prompt; every column is metadata), and,
    `baseline`, a pending greedy baseline after them (index first_index + n). The row is plain data (`to_plain`), as
    the prompt source's rows are (read by `prompt_source._rows` on its reading thread, or from a checkpoint), so
    it is not converted again here, on the step's critical path."""
    # every sample its own metadata (a hook or an agent loop may change one's): plain data, so one pickle loaded
    # once per sample, a quarter of deepcopy's time (the controller makes them on the step's critical path)
    metadata = pickle.dumps({key: value for key, value in row.items() if key != "raw_prompt_ids"},
                            protocol=pickle.HIGHEST_PROTOCOL)
    prompt_ids = [int(token) for token in row["raw_prompt_ids"]]
    return [Sample(group_index=group_index, index=first_index + i, prompt_ids=list(prompt_ids),
                   metadata=pickle.loads(metadata), is_baseline=i == n) for i in range(n + int(baseline))]


def sampled(group: list[Sample]) -> list[Sample]:
    """The group's sampled responses: what is trained and what the filters judge (all of it without a baseline)."""
    return [sample for sample in group if not sample.is_baseline]


def baseline_of(group: list[Sample]) -> Optional[Sample]:
    """The group's ReMax baseline (its last sample, is_baseline), or None."""
    return group[-1] if group and group[-1].is_baseline else None


def with_baseline(group: list[Sample], baseline: bool, index: int) -> list[Sample]:
    """The group with (a pending one added, sample `index`, from its first sample's prompt and metadata) or without
    its baseline: a buffered group of a checkpoint written by a run whose estimator did (not) use one."""
    if baseline_of(group) is not None:
        return group if baseline else sampled(group)
    if not baseline:
        return group
    first = group[0]
    return [*group, Sample(group_index=first.group_index, index=index, prompt_ids=list(first.prompt_ids),
                           metadata=copy.deepcopy(first.metadata), is_baseline=True)]


def reset_group(group: list[Sample]) -> list[Sample]:
    """The group as if never generated (its prompt goes back to the buffer when partial rollout is off)."""
    for sample in group:
        sample.response_ids, sample.loss_mask, sample.token_versions = [], [], []
        sample.rollout_log_probs, sample.reward, sample.status = None, None, PENDING
        sample.num_turns, sample.agent_metrics, sample.error, sample.resume_state = 0, None, None, None
    return group


def groups_to_batch(groups: list[list[Sample]], *, prompt_length: int, response_length: int, pad_token_id: int,
                    with_log_probs: bool, scored: bool, current_version: Optional[int] = None,
                    mask_stale_tokens: bool = False) -> DataProto:
    """The padded DataProto the trainer uses: one row per sampled response, rows in group order (a group's samples
    consecutive); a group's ReMax baseline is no row (`samples_to_batch` has the columns).

    When `scored` and the groups carry baselines (all of them must), `reward_baselines` (one value per row) is the
    reward_value() of the row's group's baseline."""
    for group in groups:
        if baseline_of(group) is None and any(sample.is_baseline for sample in group):
            raise ValueError(f"groups_to_batch: group {group[0].group_index}'s baseline is not its last sample")
    batch = samples_to_batch([sample for group in groups for sample in sampled(group)], prompt_length=prompt_length,
                             response_length=response_length, pad_token_id=pad_token_id, with_log_probs=with_log_probs,
                             scored=scored, current_version=current_version, mask_stale_tokens=mask_stale_tokens)
    baselines = [baseline_of(group) for group in groups]
    if scored and any(baseline is not None for baseline in baselines):
        if any(baseline is None for baseline in baselines):
            missing = [group[0].group_index for group, baseline in zip(groups, baselines) if baseline is None]
            raise ValueError(f"groups_to_batch: groups {missing} have no baseline, the others do")
        batch.batch["reward_baselines"] = torch.tensor(
            [baseline.reward_value() for group, baseline in zip(groups, baselines) for _ in sampled(group)],
            dtype=torch.float32)
    return batch


def samples_to_batch(samples: list[Sample], *, prompt_length: int, response_length: int, pad_token_id: int,
                     with_log_probs: bool, scored: bool, current_version: Optional[int] = None,
                     mask_stale_tokens: bool = False) -> DataProto:
    """One padded row per sample, in order (scoring pads baselines too).

    Tensors: to_batch_layout's (prompts, responses, input_ids, attention_mask, position_ids, response_mask,
    response_weight_versions and, with_log_probs, rollout_log_probs) plus, when `scored`, token_level_scores
    (each sample's reward_value() on its last trained token, the reward managers' place). Non-tensor columns: `uid`
    (the group index, which the group estimators read), every metadata key (None where a sample lacks it) and
    every key of the scorer's reward_extra_info (likewise).
    mask_stale_tokens: response_mask 0 on tokens older than `current_version`, the version the engines hold now
    (slime's mask_offpolicy_in_partial_rollout).
    """
    if not samples:
        raise ValueError("groups_to_batch / samples_to_batch: no samples")
    for sample in samples:
        if len(sample.token_versions) != sample.response_length:
            raise ValueError(f"sample {sample.index}: {len(sample.token_versions)} token versions for "
                             f"{sample.response_length} response tokens")
    masks = [list(sample.loss_mask) for sample in samples]
    if mask_stale_tokens:
        masks = [[m if version >= current_version else 0 for m, version in zip(mask, sample.token_versions)]
                 for mask, sample in zip(masks, samples)]
    batch = to_batch_layout(
        [sample.prompt_ids for sample in samples], [sample.response_ids for sample in samples],
        prompt_length=prompt_length, response_length=response_length, pad_token_id=pad_token_id,
        response_mask=masks,
        response_logprobs=[sample.rollout_log_probs or [0.0] * sample.response_length for sample in samples]
        if with_log_probs else None,
        weight_versions=[sample.token_versions for sample in samples])
    if scored:
        batch.batch["token_level_scores"] = _scores_on_last_trained_token(samples, batch.batch["response_mask"],
                                                                          response_length)
    batch.non_tensor_batch["uid"] = _column([str(sample.group_index) for sample in samples])
    for key in sorted({key for sample in samples for key in sample.metadata}):
        batch.non_tensor_batch[key] = _column([sample.metadata.get(key) for sample in samples])
    extras = [sample.metadata.get("reward_extra_info") or {} for sample in samples]
    for key in sorted({key for extra in extras for key in extra}):  # the scorer's extras as columns, as verl keeps
        batch.non_tensor_batch[key] = _column([extra.get(key) for extra in extras])  # them (GDPO's components)
    return batch


def _scores_on_last_trained_token(samples: list[Sample], response_mask: torch.Tensor,
                                  response_length: int) -> torch.Tensor:
    """The reward on the last token the model is trained on (the last response token when none is)."""
    scores = torch.zeros((len(samples), response_length), dtype=torch.float32)
    lengths = torch.tensor([sample.response_length for sample in samples], dtype=torch.long)
    trained = last_one(response_mask)
    last = torch.where(trained >= 0, trained, lengths - 1)
    rows = (lengths > 0).nonzero().flatten()
    scores[rows, last[rows]] = torch.tensor([samples[row].reward_value() for row in rows.tolist()],
                                            dtype=torch.float32)
    return scores


def _column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    for row, value in enumerate(values):  # element-wise: a list value stays one object
        column[row] = value
    return column


def partial_rollout_metrics(batch: DataProto, current_version: int) -> dict[str, float]:
    """Share of the batch's samples whose tokens span versions (continued after an abort), and how many versions
    older than `current_version` their oldest tokens are; from the batch's response_weight_versions column."""
    versions = batch.batch[WEIGHT_VERSIONS_KEY]
    stale = staleness(versions, current_version).float()
    return {"data_flow/partial_ratio": spans_versions(versions).float().mean().item(),
            "data_flow/staleness/mean": stale.mean().item() if len(stale) else 0.0,
            "data_flow/staleness/max": stale.max().item() if len(stale) else 0.0}
