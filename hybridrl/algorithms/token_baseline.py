"""The optimal token baseline's math (core_algos' optimal_token_baseline and tir_optimal_token_baseline): the
per-token path-variance weights and the per-group, per-position baselines they weigh. Pure torch."""
from __future__ import annotations

import torch


def path_variance(old_log_probs, sum_pi_squared, rollout_is_weights, response_mask) -> torch.Tensor:
    """OTB's W: the running sum over the response tokens of w = (1 - 2 pi + sum pi^2) [* IS weight^2]."""
    per_token = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        per_token = per_token * rollout_is_weights.square()
    return (per_token * response_mask).cumsum(-1)


def token_baselines(returns, path_weights, response_mask, groups: list[list[int]], handle_zero_tail: bool,
                    epsilon: float) -> torch.Tensor:
    """B_t = sum_i G_it W_it / (sum_i W_it + epsilon) per group of >= 2 rows (others: 0), and the zero tail
    where one row alone is longest (see core_algos.compute_optimal_token_baseline_advantage)."""
    mask = response_mask.to(returns.dtype)
    lengths = mask.sum(-1)
    baselines = torch.zeros_like(returns)
    for rows in groups:
        if len(rows) < 2:
            continue
        weights = path_weights[rows] * mask[rows]
        baselines[rows] = ((returns[rows] * weights).sum(0) / (weights.sum(0) + epsilon)).to(returns.dtype)
        if handle_zero_tail:
            runner_up, longest = torch.sort(lengths[rows]).values[-2:].tolist()
            if longest > runner_up:  # one sample alone reaches beyond the runner-up
                baselines[rows[int(lengths[rows].argmax())], int(runner_up):] = 0.0
    return baselines
