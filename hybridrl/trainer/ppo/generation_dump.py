"""What the policy wrote, as text: jsonl dumps of each step's generations and the validation samples to log.

``trainer.rollout_data_dir`` / ``trainer.validation_data_dir``: one file per step, ``{dir}/{step}.jsonl``, one JSON
object per response: ``{"input": prompt text, "output": response text, "score": sequence score, "step": N}``. A
training step's rows also carry what the update saw (``rollout_records``): ``reward`` (the score with any KL or length
penalty), ``advantage`` (its mean over the trained tokens), ``response_tokens``, ``group`` (the prompt's uid),
``started_version`` (the policy version its generation started under: the oldest version among its generated tokens,
where the batch carries them; so a step's staleness of each sample can be read back), and, for an answer with tokens
the policy did not write (tool results), ``turns``: the response cut into the policy's and the tool's pieces. The
groups the dynamic-sampling filter dropped follow, with ``"filtered": true`` (``filtered_records``: no reward or
advantage, they were never trained).
``trainer.rollout_data_max_mb`` bounds the rollout dumps of a long run: once their files reach it, later steps are
not dumped; the first step left out is logged as a warning and recorded in ``{dir}/size_limit_reached.json``.
``trainer.log_val_generations=N``: N validation samples per validation go to ``Tracking.log_generations`` (a table
in wandb / tensorboard / mlflow / jsonl). The N are a fixed choice across validations (same prompts every time,
sorted by input then shuffled with a fixed seed), so a table shows how the answers to the same prompts change.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY
from hybridrl.protocol import DataProto

logger = logging.getLogger(__name__)

VAL_SAMPLE_SEED = 42
SIZE_LIMIT_FILE = "size_limit_reached.json"


def decode_generations(tokenizer, batch: DataProto, scores: torch.Tensor) -> list[tuple[str, str, float]]:
    """(input, output, score) per row: the prompt and response without padding or special tokens.

    ``batch`` holds ``prompts`` (left-padded), ``responses`` (right-padded) and ``attention_mask`` over both, as
    generate_sequences returns them; ``scores`` has one number per row.
    """
    prompts, responses = batch.batch["prompts"], batch.batch["responses"]
    if len(scores) != len(prompts):
        raise ValueError(f"decode_generations: {len(scores)} scores for {len(prompts)} rows")
    prompt_mask = batch.batch["attention_mask"][:, :prompts.shape[1]].bool()
    response_mask = batch.batch["attention_mask"][:, prompts.shape[1]:].bool()
    samples = []
    for row in range(len(prompts)):
        prompt_text = tokenizer.decode(prompts[row][prompt_mask[row]], skip_special_tokens=True)
        response_text = tokenizer.decode(responses[row][response_mask[row]], skip_special_tokens=True)
        samples.append((prompt_text, response_text, float(scores[row])))
    return samples


def rollout_records(tokenizer, batch: DataProto) -> list[dict]:
    """One record per row of a trained batch (see the module docstring): what the dashboard's rollout table shows.

    Columns the batch lacks (no ``advantages`` before the update, no ``token_level_rewards`` without a reward) are
    left out of the records rather than filled in.
    """
    scores = batch.batch["token_level_scores"].sum(-1)
    records = [{"input": prompt, "output": response, "score": score}
               for prompt, response, score in decode_generations(tokenizer, batch, scores)]
    width = batch.batch["responses"].shape[1]
    written = batch.batch["attention_mask"][:, -width:].bool()
    trained = batch.batch["response_mask"].bool() if "response_mask" in batch.batch.keys() else written
    group = batch.non_tensor_batch.get("uid")
    versions = batch.batch[WEIGHT_VERSIONS_KEY] if WEIGHT_VERSIONS_KEY in batch.batch.keys() else None
    for row, record in enumerate(records):
        record["response_tokens"] = int(written[row].sum())
        if versions is not None and bool((versions[row] >= 0).any()):  # inserted and padding tokens are -1
            record["started_version"] = int(versions[row][versions[row] >= 0].min())
        if "token_level_rewards" in batch.batch.keys():
            record["reward"] = float(batch.batch["token_level_rewards"][row].sum())
        if "advantages" in batch.batch.keys():
            record["advantage"] = float(batch.batch["advantages"][row][trained[row]].mean()) \
                if trained[row].any() else 0.0
        if group is not None:
            record["group"] = str(group[row])
        if bool((written[row] & ~trained[row]).any()):
            record["turns"] = _turns(tokenizer, batch.batch["responses"][row][written[row]],
                                     trained[row][written[row]])
    return records


def filtered_records(tokenizer, groups: list) -> list[dict]:
    """One record per sampled response of the dropped groups (data/sample.Sample records; ReMax's greedy baselines
    left out): its text, score, token count and group, marked filtered."""
    records = []
    for group in groups:
        for sample in group:
            if sample.is_baseline:
                continue
            record = {"input": tokenizer.decode(sample.prompt_ids, skip_special_tokens=True),
                      "output": tokenizer.decode(sample.response_ids, skip_special_tokens=True),
                      "score": sample.reward_value(), "response_tokens": sample.response_length,
                      "group": str(sample.group_index), "filtered": True}
            if 0 in sample.loss_mask:
                record["turns"] = _turns(tokenizer, torch.tensor(sample.response_ids),
                                         torch.tensor(sample.loss_mask).bool())
            records.append(record)
    return records


def _turns(tokenizer, tokens: torch.Tensor, by_policy: torch.Tensor) -> list[dict]:
    """The response cut where the writer changes: ``[{"by": "policy" | "tool", "text": ...}, ...]``."""
    turns, start = [], 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or by_policy[end] != by_policy[start]:
            turns.append({"by": "policy" if by_policy[start] else "tool",
                          "text": tokenizer.decode(tokens[start:end], skip_special_tokens=True)})
            start = end
    return turns


def dump_generations(directory: str, step: int, records: list[dict], max_mb: float | None = None) -> str | None:
    """Write ``{directory}/{step}.jsonl`` (replacing a file left by an earlier, interrupted run); returns its path,
    or None when the directory's dumps have reached ``max_mb`` (see the module docstring)."""
    os.makedirs(directory, exist_ok=True)
    if max_mb is not None and size_limit_reached(directory, step, max_mb):
        return None
    path = os.path.join(directory, f"{step}.jsonl")
    with open(path, "w") as f:
        for record in records:
            f.write(json.dumps({**record, "step": step}) + "\n")
    return path


def size_limit_reached(directory: str, step: int, max_mb: float) -> bool:
    """Whether the dumps in ``directory`` have reached ``max_mb``; the first time they have, say so (a warning and
    size_limit_reached.json, which later steps find)."""
    marker = os.path.join(directory, SIZE_LIMIT_FILE)
    if os.path.isfile(marker):
        return True
    dumped = sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory)
                 if name.endswith(".jsonl"))
    if dumped < max_mb * 2 ** 20:
        return False
    with open(marker, "w") as f:
        json.dump({"first_step_not_dumped": step, "dumped_bytes": dumped, "max_mb": max_mb}, f)
    logger.warning("%s: its dumps reached trainer.rollout_data_max_mb=%s (%d bytes); steps from %d on are not "
                   "dumped", directory, max_mb, dumped, step)
    return True


def select_val_samples(samples: list[tuple[str, str, float]], n: int) -> list[tuple[str, str, float]]:
    """``n`` of the samples: sorted by input, shuffled with a fixed seed, the first ``n`` (all when fewer)."""
    ordered = sorted(samples, key=lambda sample: sample[0])
    order = np.random.RandomState(VAL_SAMPLE_SEED).permutation(len(ordered))
    return [ordered[i] for i in order[:n]]
