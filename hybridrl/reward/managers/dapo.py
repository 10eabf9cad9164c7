"""The DAPO reward manager: per-sample scores (as naive) plus DAPO's soft overlong penalty.

With `reward_model.overlong_buffer.enable`, the last `len` tokens of the response budget are a
buffer zone: a response of `valid_len` tokens gets

    expected_len = max_response_length - len
    penalty      = min(-(valid_len - expected_len) / len * penalty_factor, 0)

added to its score: 0 up to expected_len, falling linearly to -penalty_factor at the full budget.
The penalty is about length alone, so a sample whose scorer raised gets it too (on its score of 0).
With `overlong_buffer.log`, the extras `overlong_reward` (the penalty) and `overlong` (penalty < 0)
are reported per sample.
"""
from __future__ import annotations

from typing import Callable, Optional

from hybridrl.reward.managers.base import DecodedResponses
from hybridrl.reward.managers.naive import NaiveRewardManager
from hybridrl.reward.managers.registry import register_reward_manager


@register_reward_manager("dapo")
class DAPORewardManager(NaiveRewardManager):
    def __init__(self, tokenizer, num_examine: int, compute_score: Optional[Callable] = None,
                 reward_fn_key: str = "data_source", max_resp_len: Optional[int] = None, overlong_buffer_cfg=None):
        """max_resp_len: data.max_response_length. overlong_buffer_cfg: reward_model.overlong_buffer
        (enable, len, penalty_factor, log); None or enable=false scores exactly as naive."""
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key)
        self.overlong_buffer = overlong_buffer_cfg if overlong_buffer_cfg is not None and overlong_buffer_cfg.enable \
            else None
        if self.overlong_buffer is None:
            return
        # An argument, not a config value: load_reward_manager always passes it. That the buffer fits in it is a
        # config rule, checked before the start (reward/config_checks.py).
        if max_resp_len is None:
            raise ValueError("reward_model.overlong_buffer.enable=true needs max_resp_len (data.max_response_length)")
        self.max_resp_len = max_resp_len

    def overlong_penalty(self, valid_len: int) -> float:
        buffer = self.overlong_buffer
        expected_len = self.max_resp_len - buffer.len
        return min(-(valid_len - expected_len) / buffer.len * buffer.penalty_factor, 0.0)

    def final_rewards(self, scores: list[float], decoded: DecodedResponses) -> tuple[list[float], dict[str, list]]:
        if self.overlong_buffer is None:
            return scores, {}
        penalties = [self.overlong_penalty(length) for length in decoded.response_lengths]
        rewards = [score + penalty for score, penalty in zip(scores, penalties)]
        if not self.overlong_buffer.log:
            return rewards, {}
        return rewards, {"overlong_reward": penalties, "overlong": [penalty < 0 for penalty in penalties]}
