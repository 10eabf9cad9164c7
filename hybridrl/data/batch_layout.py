"""The batch layout every rollout hands to the trainer, built from plain token lists in one place.

Engines (HF generate, SGLang, an agent loop) return ragged per-row token lists; the trainer wants
fixed-shape tensors. `to_batch_layout` is the one function that pads them:

    prompts          [B, prompt_length]    left-padded with pad_token_id
    responses        [B, response_length]  right-padded with pad_token_id
    input_ids        prompts ++ responses
    attention_mask   1 on every real prompt and response token, 0 on padding. A hole in
                     response_mask (e.g. tool output an agent loop inserted) is still a real
                     token the model attends to, so it keeps attention 1.
    position_ids     0, 1, ... over the real prompt tokens (0 on left padding), continuing by
                     one per response column (also across the right padding), as the dataset
                     and HF generate number them
    response_mask    the given mask (0 = not trained on, e.g. tool tokens), else 1 on every
                     response token; always 0 on padding
    rollout_log_probs when given: the engine's log-probs, 0 on padding
    response_weight_versions  when given (WEIGHT_VERSIONS_KEY): per response token, the policy
                     version of the weights that generated it, as the engine server reported it
                     with the tokens (workers/rollout/async_server.py); -1 on tokens no engine
                     generated (a tool's answer, a failed loop's stand-in) and on padding

A policy version counts the training steps whose actor update produced the weights: 0 for the
initial weights, k after k updates, in every schedule (colocated, disaggregated, asynchronous).
A run resumed from the checkpoint of step N continues from N (less the trainer.critic_warmup
steps, which update no actor: trainer/ppo/checkpointing.weights_version_after).

A row longer than its length is an error naming the row: truncating would silently train on a
different sequence than the one generated. Cutting a response at its first EOS is the engine's
job (or `mask_through_first_eos`), done before calling this.
"""
from __future__ import annotations

import torch

from hybridrl.protocol import DataProto

WEIGHT_VERSIONS_KEY = "response_weight_versions"  # [B, response_length] int64, see the module docstring


def to_batch_layout(prompt_ids: list[list[int]], response_ids: list[list[int]], *, prompt_length: int,
                    response_length: int, pad_token_id: int, response_mask: list[list[int]] | None = None,
                    response_logprobs: list[list[float]] | None = None,
                    weight_versions: list[list[int]] | None = None) -> DataProto:
    """Pad ragged prompt/response token lists into the trainer's batch layout (see the module docstring)."""
    rows = len(prompt_ids)
    _check_rows("response_ids", response_ids, rows)
    if response_mask is not None:
        _check_rows("response_mask", response_mask, rows)
    if response_logprobs is not None:
        _check_rows("response_logprobs", response_logprobs, rows)
    if weight_versions is not None:
        _check_rows("weight_versions", weight_versions, rows)

    prompts = torch.full((rows, prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_length), dtype=torch.long)
    responses = torch.full((rows, response_length), pad_token_id, dtype=torch.long)
    response_attention = torch.zeros((rows, response_length), dtype=torch.long)
    loss_mask = torch.zeros((rows, response_length), dtype=torch.long)
    log_probs = torch.zeros((rows, response_length), dtype=torch.float32)
    versions = torch.full((rows, response_length), -1, dtype=torch.long)
    for row in range(rows):
        prompt, response = prompt_ids[row], response_ids[row]
        if not prompt:
            raise ValueError(f"to_batch_layout: prompt of row {row} is empty")
        if len(prompt) > prompt_length:
            raise ValueError(f"to_batch_layout: prompt of row {row} has {len(prompt)} tokens, more than "
                             f"prompt_length={prompt_length}")
        if len(response) > response_length:
            raise ValueError(f"to_batch_layout: response of row {row} has {len(response)} tokens, more than "
                             f"response_length={response_length}")
        prompts[row, prompt_length - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        prompt_mask[row, prompt_length - len(prompt):] = 1
        width = len(response)
        if width:
            responses[row, :width] = torch.tensor(response, dtype=torch.long)
        response_attention[row, :width] = 1
        loss_mask[row, :width] = 1 if response_mask is None else _row_values(
            "response_mask", response_mask[row], row, width, torch.long)
        if response_logprobs is not None:
            log_probs[row, :width] = _row_values("response_logprobs", response_logprobs[row], row, width,
                                                 torch.float32)
        if weight_versions is not None:
            versions[row, :width] = _row_values("weight_versions", weight_versions[row], row, width, torch.long)

    prompt_positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    response_positions = prompt_positions[:, -1:] + torch.arange(1, response_length + 1, dtype=torch.long)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_attention], dim=1),
        "position_ids": torch.cat([prompt_positions, response_positions], dim=1),
        "response_mask": loss_mask,
    }
    if response_logprobs is not None:
        tensors["rollout_log_probs"] = log_probs
    if weight_versions is not None:
        tensors[WEIGHT_VERSIONS_KEY] = versions
    return DataProto.from_dict(tensors)


def staleness(versions: torch.Tensor, current_version: int) -> torch.Tensor:
    """Per row that has generated tokens (version >= 0): how many versions older than `current_version` its oldest
    token is. The one measure behind data_flow/staleness/* and async_training/staleness/*."""
    generated = versions >= 0
    oldest = torch.where(generated, versions, torch.full_like(versions, current_version)).min(dim=-1).values
    return (current_version - oldest)[generated.any(dim=-1)]


def spans_versions(versions: torch.Tensor) -> torch.Tensor:
    """Per row: whether its generated tokens come from more than one version (generation continued after an abort,
    or a multi-turn sample across a weight update)."""
    generated = versions >= 0
    newest = versions.max(dim=-1).values  # padding and inserted tokens are -1
    never = torch.full_like(versions, torch.iinfo(versions.dtype).max)
    oldest = torch.where(generated, versions, never).min(dim=-1).values
    return generated.any(dim=-1) & (newest != oldest)


def _check_rows(name: str, values: list, rows: int) -> None:
    if len(values) != rows:
        raise ValueError(f"to_batch_layout: {name} has {len(values)} rows, prompt_ids has {rows}")


def _row_values(name: str, values: list, row: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """One row of a per-token list, which must be as long as that row's response."""
    if len(values) != width:
        raise ValueError(f"to_batch_layout: {name} of row {row} has {len(values)} entries, its response has {width} "
                         f"tokens")
    return torch.tensor(values, dtype=dtype)
