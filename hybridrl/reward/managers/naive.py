"""The naive reward manager: score each response on its own with a rule-based function.

For every sample it calls
    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)
on the decoded valid response tokens, several samples at once (reward_model.max_concurrent); everything around
that call (reward on the last valid token, dict scores and their extras, rm_scores, a scorer that raises, the
timeout) is `RewardManagerBase`'s.
"""
from __future__ import annotations

from typing import Callable, Optional

from hybridrl.reward.managers.base import DecodedResponses, RewardManagerBase, ScorerCall
from hybridrl.reward.managers.registry import register_reward_manager
from hybridrl.reward.scorers import default_compute_score


@register_reward_manager("naive")
class NaiveRewardManager(RewardManagerBase):
    def __init__(self, tokenizer, num_examine: int, compute_score: Optional[Callable] = None,
                 reward_fn_key: str = "data_source"):
        """compute_score: a per-sample scorer; None means the built-in scorers, chosen by data_source."""
        super().__init__(tokenizer, num_examine, compute_score or default_compute_score, reward_fn_key)

    def score_samples(self, decoded: DecodedResponses) -> list:
        return self.score_calls([ScorerCall(decoded.describe(i), {
            "data_source": decoded.data_sources[i], "solution_str": decoded.solution_strs[i],
            "ground_truth": decoded.ground_truths[i], "extra_info": decoded.extra_infos[i]})
            for i in range(len(decoded))])
