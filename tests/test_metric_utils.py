"""Trainer metrics computed from a batch, against hand-computed numbers."""
import math

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.metric_utils import compute_rollout_probs_diff


def test_rollout_probs_diff_is_over_response_tokens_in_probability_space():
    rollout = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.1, 0.3, 0.3]]))
    actor = torch.log(torch.tensor([[0.4, 0.2, 0.1], [0.1, 0.6, 0.9]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the 0.9 vs 0.1 token is padding: it must not count
    batch = DataProto.from_dict({"rollout_log_probs": rollout, "old_log_probs": actor, "response_mask": mask})
    diffs = torch.tensor([0.1, 0.0, 0.0, 0.3, 0.6])
    metrics = compute_rollout_probs_diff(batch)
    assert metrics["training/rollout_probs_diff_mean"] == pytest.approx(0.2, abs=1e-6)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.6, abs=1e-6)
    assert metrics["training/rollout_probs_diff_std"] == pytest.approx(float(diffs.std()), abs=1e-6)
    assert not math.isnan(metrics["training/rollout_probs_diff_std"])


def test_no_rollout_log_probs_no_metric():
    batch = DataProto.from_dict({"old_log_probs": torch.zeros(2, 3), "response_mask": torch.ones(2, 3)})
    assert compute_rollout_probs_diff(batch) == {}


def test_lengths_count_masked_tool_tokens_but_advantages_only_trained_ones():
    from hybridrl.trainer.ppo.metric_utils import compute_data_metrics
    from hybridrl.data.batch_layout import to_batch_layout

    # row 0: 2 model tokens, 2 tool tokens (mask 0), 1 model token = 5 of 5 (clipped); row 1: 2 model tokens
    batch = to_batch_layout([[7, 8], [9]], [[1, 2, 3, 4, 5], [6, 2]], prompt_length=2, response_length=5,
                            pad_token_id=0, response_mask=[[1, 1, 0, 0, 1], [1, 1]])
    advantages = torch.tensor([[1.0, 1.0, 9.0, 9.0, 1.0], [-1.0, -1.0, 0.0, 0.0, 0.0]]) * 1.0
    advantages = advantages * batch.batch["response_mask"]
    batch.batch.update({"token_level_scores": torch.zeros(2, 5), "token_level_rewards": torch.zeros(2, 5),
                        "advantages": advantages, "returns": advantages})
    metrics = compute_data_metrics(batch, use_critic=False)
    assert metrics["response_length/mean"] == pytest.approx(3.5)
    assert metrics["response_length/clip_ratio"] == pytest.approx(0.5)
    assert metrics["critic/advantages/max"] == pytest.approx(1.0)  # the tool tokens' 9s are masked out
    assert metrics["critic/advantages/mean"] == pytest.approx(1.0 / 5)
