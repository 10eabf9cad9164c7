"""The data-parallel PPO critic: values of response tokens and the clipped value-loss update.

The update runs the loop it shares with the actor (workers/ppo_update_loop.py): a rank's rows are split
into mini-batches (one optimizer step each) and micro-batches (gradients accumulated, each micro loss
normalised by the counts of the whole global mini-batch, so neither the micro-batch size nor the
number of data-parallel ranks changes the gradient); this module gives it the clipped value loss. The model is a causal LM backbone with a
one-output token-classification head. `use_dynamic_bsz` (token budgets `ppo_max_token_len_per_gpu` for updates,
`forward_max_token_len_per_gpu` for compute_values) and `use_remove_padding` (the critic ModelSpec's) work as in
the actor.

Batch keys read: input_ids, attention_mask, position_ids, responses, response_mask (all passes);
values (the rollout-time values, for clipping) and returns (update).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridrl.algorithms.core_algos import compute_value_loss
from hybridrl.models.attention import padded_attention_mask
from hybridrl.protocol import DataProto
from hybridrl.utils.distributed import device_name
from hybridrl.models.padding import response_values_packed
from hybridrl.algorithms.torch_functional import masked_mean
from hybridrl.workers.out_of_memory import memory_remedies, training_memory_error
from hybridrl.workers.ppo_update_loop import (MicroBatchLoss, PPOUpdateLoop, in_row_order, micro_batches_of,
                                              rows_per_rank, take_keys)

FORWARD_KEYS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]  # every pass's
UPDATE_KEYS = FORWARD_KEYS + ["values", "returns"]


class DataParallelPPOCritic:
    def __init__(self, config: Any, critic_module: nn.Module, critic_optimizer: torch.optim.Optimizer, *,
                 rollout_n: int, device: str | None = None, use_remove_padding: bool = False):
        """`config` is the critic section; rollout_n as for the actor (mini-batches count prompts).
        use_remove_padding: the critic ModelSpec's (packed forwards)."""
        self.config = config
        self.critic_module = critic_module
        self.critic_optimizer = critic_optimizer
        self.device = torch.device(device or device_name())
        dynamic = config.use_dynamic_bsz
        self.max_token_len = config.ppo_max_token_len_per_gpu if dynamic else None
        self.forward_max_token_len = config.forward_max_token_len_per_gpu if dynamic else None
        self.use_remove_padding = use_remove_padding
        self.update_loop = PPOUpdateLoop(
            role="critic", module=critic_module, optimizer=critic_optimizer, device=self.device,
            ppo_epochs=config.ppo_epochs, shuffle=config.shuffle, grad_clip=config.grad_clip,
            mini_batch_size=rows_per_rank(config.ppo_mini_batch_size, rollout_n, "critic.ppo_mini_batch_size"),
            micro_batch_size=config.ppo_micro_batch_size_per_gpu, max_token_len=self.max_token_len,
            memory_remedies=memory_remedies(
                "critic", "critic.model", token_budget=("ppo_max_token_len_per_gpu", self.max_token_len),
                row_budget=("ppo_micro_batch_size_per_gpu", config.ppo_micro_batch_size_per_gpu),
                gradient_checkpointing=config.model.enable_gradient_checkpointing))
        self.forward_remedies = memory_remedies(
            "critic", "critic.model", token_budget=("forward_max_token_len_per_gpu", self.forward_max_token_len),
            row_budget=("forward_micro_batch_size_per_gpu", config.forward_micro_batch_size_per_gpu))

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
                try:
                    values.append((self._forward_micro_batch(micro_batch) * mask).cpu())
                except torch.OutOfMemoryError as error:
                    raise training_memory_error("compute_values", micro_batch, self.device,
                                                self.forward_remedies) from error
        return in_row_order(torch.cat(values), order)

    def update_critic(self, data: DataProto) -> dict[str, list[float]]:
        """ppo_epochs passes of mini-batch steps (workers/ppo_update_loop.py); metrics (one value per step)
        averaged over the ranks: critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean, critic/grad_norm."""
        rows = take_keys(data, UPDATE_KEYS, "update_critic")
        return self.update_loop.run(rows, self._micro_batch_loss, "update_critic")

    def _micro_batch_loss(self, micro_batch: dict[str, torch.Tensor], batch_info: dict[str, float]) -> MicroBatchLoss:
        """The clipped value loss of one micro-batch (its share of the global mini-batch's loss) and its metrics."""
        response_mask = micro_batch["response_mask"].to(self.device)
        vpreds = self._forward_micro_batch(micro_batch)
        vf_loss, vf_clipfrac = compute_value_loss(
            vpreds=vpreds, returns=micro_batch["returns"].to(self.device),
            values=micro_batch["values"].to(self.device), response_mask=response_mask,
            cliprange_value=self.config.cliprange_value, loss_agg_mode=self.config.loss_agg_mode,
            loss_scale_factor=self.config.loss_scale_factor, **batch_info)
        return MicroBatchLoss(vf_loss, loss_terms={"critic/vf_loss": vf_loss.detach()},
                              token_metrics={"critic/vf_clipfrac": vf_clipfrac,
                                             "critic/vpred_mean": masked_mean(vpreds.detach(), response_mask)})
