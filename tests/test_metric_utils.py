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
