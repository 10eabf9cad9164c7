"""The data-parallel PPO critic: values of response tokens and the clipped value-loss update.

Same batch plumbing as the actor (see workers/actor/dp_actor.py): a rank's rows are split into
mini-batches (one optimizer step each) and micro-batches (gradients accumulated, each micro loss
normalised by the counts of the whole global mini-batch, so neither the micro-batch size nor the
number of data-parallel ranks changes the gradient). The model is a causal LM backbone with a
one-output token-classification head. `use_dynamic_bsz` (token budgets `ppo_max_token_len_per_gpu` for updates,
`forward_max_token_len_per_gpu` for compute_values) and `model.use_remove_padding` work as in
the actor.

Batch keys read: input_ids, attention_mask, position_ids, responses, response_mask (all passes);
values (the rollout-time values, for clipping) and returns (update).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from hybridrl.models.attention import padded_attention_mask
from hybridrl.protocol import DataProto
from hybridrl.algorithms.core_algos import compute_value_loss
from hybridrl.utils.distributed import device_name
from hybridrl.utils.fsdp_utils import clip_grad_norm
from hybridrl.utils.padding import response_values_packed
from hybridrl.utils.torch_functional import masked_mean
from hybridrl.workers.actor.dp_actor import (in_row_order, mean_over_ranks, micro_batches_of, mini_batch_global_info,
                                             rows_per_rank, share_of_global_tokens, take_keys)

FORWARD_KEYS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]


class DataParallelPPOCritic:
    def __init__(self, config: Any, critic_module: nn.Module, critic_optimizer: torch.optim.Optimizer, *,
                 rollout_n: int, device: str | None = None):
        """`config` is the critic section; rollout_n as for the actor (mini-batches count prompts)."""
        self.config = config
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        self.device = torch.device(device or device_name())
        self.mini_batch_size = rows_per_rank(config.ppo_mini_batch_size, rollout_n, "critic.ppo_mini_batch_size")
        dynamic = config.use_dynamic_bsz
        self.max_token_len = config.ppo_max_token_len_per_gpu if dynamic else None
        self.forward_max_token_len = config.forward_max_token_len_per_gpu if dynamic else None
        self.use_remove_padding = config.model.use_remove_padding

    def _forward_micro_batch(self, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """V(state before each response token), (rows, response_length) float32.

        The value head's output at position t scores the prefix ending at t, i.e. the state in which
        token t+1 is chosen; the response's values are the positions ending one before the last.
        """
        response_length = micro_batch["responses"].shape[1]
        if self.use_remove_padding:
            return response_values_packed(self.critic_module, micro_batch["input_ids"].to(self.device),
                                          micro_batch["attention_mask"].to(self.device),
                                          micro_batch["position_ids"].to(self.device), response_length)
        output = self.critic_module(input_ids=micro_batch["input_ids"].to(self.device),
                                    attention_mask=padded_attention_mask(micro_batch["attention_mask"].to(self.device)),
                                    position_ids=micro_batch["position_ids"].to(self.device), use_cache=False)
        return output.logits[:, -response_length - 1:-1, 0].float()

    def compute_values(self, data: DataProto) -> torch.Tensor:
        """Values of the response tokens, 0 outside response_mask, on the CPU."""
        rows = take_keys(data, FORWARD_KEYS, "compute_values")
        self.critic_module.eval()
        micro_batches, order = micro_batches_of(rows, self.config.forward_micro_batch_size_per_gpu,
                                                self.forward_max_token_len)
        values = []
        with torch.no_grad():
            for micro_batch in micro_batches:
                mask = micro_batch["response_mask"].to(self.device)
                values.append((self._forward_micro_batch(micro_batch) * mask).cpu())
        return in_row_order(torch.cat(values), order)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """ppo_epochs passes of mini-batch steps; metrics (one value per step) averaged over the ranks."""
        rows = take_keys(data, FORWARD_KEYS + ["values", "returns"], "update_critic")
        num_rows = len(rows["input_ids"])
        if num_rows % self.mini_batch_size:
            raise ValueError(f"update_critic: this rank got {num_rows} rows, not a multiple of its mini-batch of "
                             f"{self.mini_batch_size} rows (critic.ppo_mini_batch_size x rollout.n / world size)")
        self.critic_module.train()
        metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.config.ppo_epochs):
            order = torch.randperm(num_rows) if self.config.shuffle else torch.arange(num_rows)
            for start in range(0, num_rows, self.mini_batch_size):
                mini_batch = {key: value[order[start:start + self.mini_batch_size]] for key, value in rows.items()}
                for key, value in self._update_mini_batch(mini_batch).items():
                    metrics[key].append(value)
        return mean_over_ranks(metrics, self.device)

    def _update_mini_batch(self, mini_batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """Accumulate, clip, step; a NaN/inf global gradient norm skips the step, as in the actor."""
        self.critic_optimizer.zero_grad()
        batch_info = mini_batch_global_info(mini_batch["response_mask"], self.device)
        totals: dict[str, float] = defaultdict(float)
        for micro_batch in micro_batches_of(mini_batch, self.config.ppo_micro_batch_size_per_gpu,
                                            self.max_token_len)[0]:
            token_share = share_of_global_tokens(micro_batch["response_mask"], batch_info)
            response_mask = micro_batch["response_mask"].to(self.device)
            vpreds = self._forward_micro_batch(micro_batch)
            vf_loss, vf_clipfrac = compute_value_loss(
                vpreds=vpreds, returns=micro_batch["returns"].to(self.device),
                values=micro_batch["values"].to(self.device), response_mask=response_mask,
                cliprange_value=self.config.cliprange_value, loss_agg_mode=self.config.loss_agg_mode,
                global_batch_info=batch_info)
            vf_loss.backward()
            totals["critic/vf_loss"] += float(vf_loss.detach())  # a share of the global loss: they add up
            totals["critic/vf_clipfrac"] += float(vf_clipfrac) * token_share
            totals["critic/vpred_mean"] += float(masked_mean(vpreds.detach(), response_mask)) * token_share
        grad_norm = clip_grad_norm(self.critic_module, self.config.grad_clip)
        if torch.isfinite(torch.tensor(grad_norm)):
            self.critic_optimizer.step()
        else:  # the norm is global, so every rank skips together
            self.critic_optimizer.zero_grad()
        totals["critic/grad_norm"] = grad_norm
        return dict(totals)
