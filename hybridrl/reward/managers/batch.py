"""The batch reward manager: ONE call of the user's scoring function over the whole batch.

For scorers that are cheaper in bulk (a judge model, a sandbox, a vectorised checker):
    compute_score(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...])
returns one float or dict per sample, in order. If that call raises, the failure cannot be pinned
on a sample, so every sample is scored again alone (lists of one, reward_model.max_concurrent at once): only the
samples that still raise cost their score (see `RewardManagerBase`).
"""
from __future__ import annotations

from typing import Callable, Optional

from hybridrl.reward.managers.base import DecodedResponses, RewardManagerBase, ScorerCall, ScorerFailure
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
        everyone = range(len(decoded))
        whole_batch = _call(f"the batch of {len(decoded)} samples", decoded, everyone)
        results = _scores_of(self.score_calls([whole_batch])[0], len(decoded))
        if not isinstance(results, ScorerFailure):
            return results
        alone = self.score_calls([_call(f"{decoded.describe(i)} alone", decoded, [i]) for i in everyone])
        return [_only(_scores_of(result, 1)) for result in alone]


def _scores_of(results, rows: int) -> "list | ScorerFailure":
    """One call's result: its failure, or its list of `rows` scores (anything else breaks the batch contract)."""
    if isinstance(results, ScorerFailure):
        return results
    if not isinstance(results, (list, tuple)) or len(results) != rows:
        raise ValueError(f"the batch compute_score must return a list with one score per sample ({rows}), "
                         f"got {type(results).__name__}"
                         + (f" of length {len(results)}" if isinstance(results, (list, tuple)) else ""))
    return list(results)


def _call(what: str, decoded: DecodedResponses, rows) -> ScorerCall:
    """One call of the batch scoring function over `rows` of the batch, as lists."""
    return ScorerCall(what, {"data_sources": [decoded.data_sources[i] for i in rows],
                             "solution_strs": [decoded.solution_strs[i] for i in rows],
                             "ground_truths": [decoded.ground_truths[i] for i in rows],
                             "extra_infos": [decoded.extra_infos[i] for i in rows]})


def _only(results: "list | ScorerFailure"):
    return results if isinstance(results, ScorerFailure) else results[0]
