"""The naive reward manager: score each response on its own with a rule-based function.

For every sample it decodes the valid response tokens, calls
    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)
and writes the score on the LAST valid response token (the response part of attention_mask;
with an EOS that is the EOS) of a (batch, response_length) tensor
(the trainer stores it as `token_level_scores`). A scorer may return a dict: "score" is the
reward and every other key becomes a per-sample list in `reward_extra_info` (for metrics).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Optional

import torch

from hybridrl.utils.reward_score import default_compute_score
from hybridrl.workers.reward_manager.registry import register_reward_manager


@register_reward_manager("naive")
class NaiveRewardManager:
    def __init__(self, tokenizer, num_examine: int, compute_score: Optional[Callable] = None,
                 reward_fn_key: str = "data_source"):
        self.tokenizer = tokenizer
        self.num_examine = num_examine  # how many decoded samples per data source to print
        self.compute_score = compute_score or default_compute_score
        self.reward_fn_key = reward_fn_key

    def __call__(self, data, return_dict: bool = False):
        """`data`: a DataProto with prompts, responses, attention_mask and non-tensor reward_model (+ reward_fn_key)."""
        responses = data.batch["responses"]
        prompts = data.batch["prompts"]
        prompt_mask = data.batch["attention_mask"][:, :prompts.shape[-1]]
        response_mask = data.batch["attention_mask"][:, prompts.shape[-1]:]
        extra_infos = data.non_tensor_batch.get("extra_info")
        reward_tensor = torch.zeros(responses.shape, dtype=torch.float32, device=responses.device)
        extras_per_sample: list[dict[str, Any]] = []
        printed_per_source: dict[str, int] = defaultdict(int)

        for i in range(responses.shape[0]):
            last_token = _last_valid_position(response_mask[i], sample=i)
            response_str = self._decode(responses[i], response_mask[i])
            data_source = data.non_tensor_batch[self.reward_fn_key][i]
            ground_truth = data.non_tensor_batch["reward_model"][i]["ground_truth"]
            result = self.compute_score(data_source=data_source, solution_str=response_str, ground_truth=ground_truth,
                                        extra_info=None if extra_infos is None else extra_infos[i])
            score, extras = _split_score(result, data_source)
            reward_tensor[i, last_token] = score
            extras_per_sample.append(extras)

            if printed_per_source[data_source] < self.num_examine:
                printed_per_source[data_source] += 1
                print(f"[prompt] {self._decode(prompts[i], prompt_mask[i])}\n[response] {response_str}\n"
                      f"[ground_truth] {ground_truth}\n[score] {score}"
                      + "".join(f"\n[{key}] {value}" for key, value in extras.items()))

        if return_dict:
            return {"reward_tensor": reward_tensor, "reward_extra_info": _columns(extras_per_sample)}
        return reward_tensor

    def _decode(self, token_ids: torch.Tensor, mask: torch.Tensor) -> str:
        return self.tokenizer.decode(token_ids[mask.bool()], skip_special_tokens=True)


def _last_valid_position(response_mask_row: torch.Tensor, sample: int) -> int:
    valid = response_mask_row.nonzero()
    if valid.numel() == 0:
        raise ValueError(f"sample {sample} has an empty response (no valid token to put its reward on)")
    return int(valid[-1])


def _split_score(result, data_source: str) -> tuple[float, dict[str, Any]]:
    """A scorer's float, or its dict's "score" plus the other keys."""
    if isinstance(result, dict):
        if "score" not in result:
            raise KeyError(f"the scorer for {data_source!r} returned a dict without 'score': keys {sorted(result)}")
        extras = {key: value for key, value in result.items() if key != "score"}
        return float(result["score"]), extras
    return float(result), {}


def _columns(extras_per_sample: list[dict[str, Any]]) -> dict[str, list]:
    """Per-sample extras -> one list per key; every sample must report the same keys, so lists line up."""
    keys = set(extras_per_sample[0]) if extras_per_sample else set()
    for i, extras in enumerate(extras_per_sample):
        if set(extras) != keys:
            raise ValueError(f"sample {i} returned extra keys {sorted(extras)}, sample 0 returned {sorted(keys)}; "
                             "every sample of a batch must return the same keys")
    return {key: [extras[key] for extras in extras_per_sample] for key in sorted(keys)}
