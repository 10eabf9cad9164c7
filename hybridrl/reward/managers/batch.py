"""The batch reward manager: ONE call of the user's scoring function over the whole batch.

For scorers that are cheaper in bulk (a judge model, a sandbox, a vectorised checker):
    compute_score(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...])
returns one float or dict per sample, in order. If that call raises, the failure cannot be pinned
on a sample, so every sample is scored again alone (lists of one): only the samples that still
raise cost their score (see `RewardManagerBase`).
"""
from __future__ import annotations

from typing import Callable, Optional

from hybridrl.reward.managers.base import DecodedResponses, RewardManagerBase, ScorerFailure
from hybridrl.reward.managers.registry import register_reward_manager


@register_reward_manager("batch")
class BatchRewardManager(RewardManagerBase):
    def __init__(self, tokenizer, num_examine: int, compute_score: Optional[Callable] = None,
                 reward_fn_key: str = "data_source"):
        if compute_score is None:
            raise ValueError("reward_model.reward_manager=batch calls one function over lists of samples; set "
                             "custom_reward_function.path/name to a function taking data_sources, solution_strs, "
                             "ground_truths, extra_infos (the built-in scorers take one sample)")
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key)

    def score_samples(self, decoded: DecodedResponses) -> list:
        results = self._score_rows(f"the batch of {len(decoded)} samples", decoded, range(len(decoded)))
        if not isinstance(results, ScorerFailure):
            return results
        return [_only(self._score_rows(f"sample {i} (data_source {decoded.data_sources[i]!r}) alone", decoded, [i]))
                for i in range(len(decoded))]

    def _score_rows(self, what: str, decoded: DecodedResponses, rows) -> "list | ScorerFailure":
        rows = list(rows)
        results = self.call_scorer(what, self.compute_score,
                                   data_sources=[decoded.data_sources[i] for i in rows],
                                   solution_strs=[decoded.solution_strs[i] for i in rows],
                                   ground_truths=[decoded.ground_truths[i] for i in rows],
                                   extra_infos=[decoded.extra_infos[i] for i in rows])
        if isinstance(results, ScorerFailure):
            return results
        if not isinstance(results, (list, tuple)) or len(results) != len(rows):
            raise ValueError(f"the batch compute_score must return a list with one score per sample ({len(rows)}), "
                             f"got {type(results).__name__}"
                             + (f" of length {len(results)}" if isinstance(results, (list, tuple)) else ""))
        return list(results)


def _only(results: "list | ScorerFailure"):
    return results if isinstance(results, ScorerFailure) else results[0]
