"""The data-parallel PPO actor: log-probs of responses and the policy update, on one rank's share of a batch.

Each rank holds a slice of the batch (the worker group splits it) and an FSDP-sharded model; FSDP
averages gradients over the ranks during backward. The update runs the loop it shares with the critic
(workers/ppo_update_loop.py: epochs, mini-batches, micro-batches, the loss normalised by the global
mini-batch's counts); this module gives it the policy loss of one micro-batch (`_micro_batch_loss`: the
configured policy loss, minus entropy_coeff x entropy, plus kl_loss_coef x KL to the reference). The policy
loss reads the global counts from `config.global_batch_info`, as in verl.

Micro-batches are either `ppo_micro_batch_size_per_gpu` consecutive rows or, with `use_dynamic_bsz`,
token-budget groups of at most `ppo_max_token_len_per_gpu` attended tokens (for compute_log_prob the
worker's log-prob sizes). With `use_remove_padding` each micro-batch runs as one packed row of its real
tokens (models/padding.py); with `ulysses_sequence_parallel_size` P > 1 the micro-batches of P consecutive ranks
form one packed row, each rank running 1/P of its tokens (models/sequence_parallel.py). With `use_fused_kernels`
the output layer is fused into the log-prob computation, so no full-vocabulary logits are ever held
(models/fused_logprob.py); it combines with either layout.

Batch keys read: input_ids, attention_mask, position_ids, responses (all passes); response_mask,
old_log_probs, advantages, ref_log_prob with use_kl_loss, and rollout_is_weights when the trainer's rollout
correction added them (update; the policy loss multiplies its per-token loss by them). meta_info: temperature.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridrl.algorithms.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from hybridrl.models.attention import padded_attention_mask
from hybridrl.protocol import DataProto
from hybridrl.utils.distributed import device_name
from hybridrl.models.fused_logprob import response_log_probs_fused
from hybridrl.models.fsdp_utils import fsdp_root, hf_module
from hybridrl.models.padding import response_log_probs_packed
from hybridrl.models.sequence_parallel import (response_log_probs_sequence_parallel, sequence_parallel_group,
                                               use_ulysses_attention)
from hybridrl.algorithms.torch_functional import entropy_function, logprobs_from_logits
from hybridrl.workers.out_of_memory import memory_remedies, training_memory_error
from hybridrl.workers.ppo_update_loop import (MicroBatchLoss, PPOUpdateLoop, in_row_order, micro_batches_of,
                                              rows_per_rank, take_keys)

FORWARD_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]  # what every pass reads


def update_keys(use_kl_loss: bool, available) -> list[str]:
    """The batch tensors update_policy reads, of the `available` keys (rollout_is_weights only where the trainer's
    rollout correction added them); the trainer sends the update only these (trainer/ppo/worker_inputs.py)."""
    keys = FORWARD_KEYS + ["response_mask", "old_log_probs", "advantages"]
    keys += ["ref_log_prob"] if use_kl_loss else []
    keys += ["rollout_is_weights"] if "rollout_is_weights" in available else []
    return keys


class DataParallelPPOActor:
    def __init__(self, config: Any, actor_module: nn.Module, actor_optimizer: torch.optim.Optimizer | None = None, *,
                 rollout_n: int | None = None, log_prob_micro_batch_size: int | None = None,
                 log_prob_max_token_len: int | None = None, use_remove_padding: bool = False,
                 use_fused_kernels: bool = False, gradient_checkpointing: bool = False, device: str | None = None):
        """`config` is the actor section (or the ref section for a frozen reference, no optimizer).

        rollout_n (required with an optimizer): responses per prompt; `ppo_mini_batch_size` counts
        prompts, so a rank's mini-batch holds ppo_mini_batch_size * rollout_n / world_size rows.
        log_prob_micro_batch_size: rows per forward in compute_log_prob; log_prob_max_token_len
        (dynamic batch size) replaces it by a token budget per forward. The worker resolves both from
        the rollout/ref config. use_remove_padding: `model.use_remove_padding` (packed forwards).
        use_fused_kernels: `model.use_fused_kernels` (log-probs fused with the output layer).
        gradient_checkpointing: `model.enable_gradient_checkpointing`, for the out-of-memory error's advice only.
        """
        self.config = config
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self.device = torch.device(device or device_name())
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        self.log_prob_max_token_len = log_prob_max_token_len
        self.use_remove_padding = use_remove_padding
        self.use_fused_kernels = use_fused_kernels
        # verl's entropy memory keys; the fused kernels never hold the logits, so they need neither
        self.entropy_from_logits = entropy_function(config.entropy_from_logits_with_chunking,
                                                    config.entropy_checkpointing)
        # verl's Ulysses sequence parallelism over groups of P ranks (packed forwards only: a config check)
        self.sequence_parallel_group = None
        if config.ulysses_sequence_parallel_size > 1:
            self.sequence_parallel_group = sequence_parallel_group(config.ulysses_sequence_parallel_size)
            use_ulysses_attention(fsdp_root(hf_module(actor_module)))
        # a frozen reference sizes its passes by actor_rollout_ref.ref.*, the actor's log-probs by .rollout.*
        self.log_prob_remedies = memory_remedies(
            "actor_rollout_ref." + ("rollout" if actor_optimizer is not None else "ref"), "actor_rollout_ref.model",
            token_budget=("log_prob_max_token_len_per_gpu", log_prob_max_token_len),
            row_budget=("log_prob_micro_batch_size_per_gpu", log_prob_micro_batch_size),
            fused_kernels=use_fused_kernels)
        if actor_optimizer is not None:
            if rollout_n is None:
                raise ValueError("DataParallelPPOActor with an optimizer needs rollout_n (actor_rollout_ref.rollout.n)")
            self.policy_loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)
            max_token_len = config.ppo_max_token_len_per_gpu if config.use_dynamic_bsz else None
            self.update_loop = PPOUpdateLoop(
                role="actor", module=actor_module, optimizer=actor_optimizer, device=self.device,
                ppo_epochs=config.ppo_epochs, shuffle=config.shuffle, grad_clip=config.grad_clip,
                mini_batch_size=rows_per_rank(config.ppo_mini_batch_size, rollout_n, "actor.ppo_mini_batch_size"),
                micro_batch_size=config.ppo_micro_batch_size_per_gpu,
                max_token_len=max_token_len,
                memory_remedies=memory_remedies(
                    "actor_rollout_ref.actor", "actor_rollout_ref.model",
                    token_budget=("ppo_max_token_len_per_gpu", max_token_len),
                    row_budget=("ppo_micro_batch_size_per_gpu", config.ppo_micro_batch_size_per_gpu),
                    gradient_checkpointing=gradient_checkpointing, fused_kernels=use_fused_kernels))

    # ------------------------------------------------------------------ forward
    def _forward_micro_batch(self, micro_batch: dict[str, torch.Tensor], temperature: float,
                             calculate_entropy: bool, entropy_grad: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of the response tokens, (rows, response_length) float32.

        The logit at position t predicts token t+1, so the response's logits are the
        `response_length` positions ending one before the last. The entropy carries a gradient
        only with entropy_grad (it is in the loss); otherwise it is a detached metric.
        """
        if self.use_fused_kernels:
            inputs = [micro_batch[key].to(self.device) for key in FORWARD_KEYS]
            return response_log_probs_fused(self.actor_module, *inputs, temperature, calculate_entropy, entropy_grad,
                                            remove_padding=self.use_remove_padding)
        if self.sequence_parallel_group is not None:  # packed, as below, over the group's ranks
            inputs = [micro_batch[key].to(self.device) for key in FORWARD_KEYS]
            return response_log_probs_sequence_parallel(self.actor_module, self.sequence_parallel_group, *inputs,
                                                        temperature, calculate_entropy, entropy_grad,
                                                        self.entropy_from_logits)
        if self.use_remove_padding:  # packed: 0 (not arbitrary numbers) at response padding; both are masked
            inputs = [micro_batch[key].to(self.device) for key in FORWARD_KEYS]
            return response_log_probs_packed(self.actor_module, *inputs, temperature, calculate_entropy, entropy_grad,
                                             self.entropy_from_logits)
        response_length = micro_batch["responses"].shape[1]
        output = self.actor_module(input_ids=micro_batch["input_ids"].to(self.device),
                                   attention_mask=padded_attention_mask(micro_batch["attention_mask"].to(self.device)),
                                   position_ids=micro_batch["position_ids"].to(self.device), use_cache=False)
        logits = output.logits[:, -response_length - 1:-1, :] / temperature
        log_probs = logprobs_from_logits(logits, micro_batch["responses"].to(self.device))
        if not calculate_entropy:
            return log_probs, None
        if entropy_grad:
            return log_probs, self.entropy_from_logits(logits)
        with torch.no_grad():
            return log_probs, self.entropy_from_logits(logits.detach())

    def compute_log_prob(self, data: DataProto, calculate_entropy: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and per-token entropy) of `responses` under logits / meta_info["temperature"], on the CPU."""
        if not self.log_prob_micro_batch_size and self.log_prob_max_token_len is None:
            raise ValueError("compute_log_prob needs log_prob_micro_batch_size (rows per forward) or "
                             "log_prob_max_token_len (tokens per forward)")
        temperature = _temperature(data.meta_info)
        rows = take_keys(data, FORWARD_KEYS, "compute_log_prob")
        micro_batches, order = micro_batches_of(rows, self.log_prob_micro_batch_size, self.log_prob_max_token_len)
        self.actor_module.eval()
        log_probs, entropies = [], []
        with torch.no_grad():
            for micro_batch in micro_batches:
                try:
                    log_prob, entropy = self._forward_micro_batch(micro_batch, temperature, calculate_entropy)
                except torch.OutOfMemoryError as error:
                    raise training_memory_error("compute_log_prob", micro_batch, self.device,
                                                self.log_prob_remedies) from error
                log_probs.append(log_prob.cpu())
                entropies.append(entropy.cpu() if calculate_entropy else None)
        log_prob = in_row_order(torch.cat(log_probs), order)
        return log_prob, (in_row_order(torch.cat(entropies), order) if calculate_entropy else None)

    # ------------------------------------------------------------------ update
    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """ppo_epochs passes of mini-batch steps over this rank's rows (workers/ppo_update_loop.py); metrics hold
        one value per step, averaged over the ranks: actor/pg_loss, actor/entropy, (actor/kl_loss, actor/kl_coef),
        the policy loss's own token-mean metrics, actor/grad_norm."""
        if self.actor_optimizer is None:
            raise RuntimeError("update_policy on an actor without optimizer (a reference policy is frozen)")
        rows = take_keys(data, update_keys(self.config.use_kl_loss, data.batch.keys()), "update_policy")
        temperature = _temperature(data.meta_info)
        fixed_metrics = {"actor/kl_coef": float(self.config.kl_loss_coef)} if self.config.use_kl_loss else None
        return self.update_loop.run(rows, lambda micro_batch, batch_info: self._micro_batch_loss(
            micro_batch, temperature, batch_info), "update_policy", fixed_metrics)

    def _micro_batch_loss(self, micro_batch: dict[str, torch.Tensor], temperature: float,
                          batch_info: dict[str, float]) -> MicroBatchLoss:
        """The loss of one micro-batch, its aggregated terms and the policy loss's token-mean metrics; the loss
        and its terms are this micro-batch's share of the global mini-batch's loss (times dp_size)."""
        config, mode = self.config, self.config.loss_agg_mode
        batch_info = {**batch_info, "loss_scale_factor": config.loss_scale_factor}
        config.global_batch_info = batch_info  # what the policy loss aggregates by (losses.global_batch_info)
        entropy_in_loss = config.entropy_coeff != 0  # else the entropy is only reported
        log_prob, entropy = self._forward_micro_batch(micro_batch, temperature, calculate_entropy=True,
                                                      entropy_grad=entropy_in_loss)
        response_mask = micro_batch["response_mask"].to(self.device)
        # Only with algorithm.rollout_correction.rollout_is set: a user's loss without the argument still runs.
        is_weights = ({"rollout_is_weights": micro_batch["rollout_is_weights"].to(self.device)}
                      if "rollout_is_weights" in micro_batch else {})
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=micro_batch["old_log_probs"].to(self.device), log_prob=log_prob,
            advantages=micro_batch["advantages"].to(self.device), response_mask=response_mask,
            loss_agg_mode=mode, config=config, **is_weights)
        entropy_loss = agg_loss(entropy, response_mask, mode, **batch_info)
        loss = pg_loss - config.entropy_coeff * entropy_loss if entropy_in_loss else pg_loss
        terms = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy_loss.detach()}
        if config.use_kl_loss:
            kl = kl_penalty(log_prob, micro_batch["ref_log_prob"].to(self.device), config.kl_loss_type)
            kl_loss = agg_loss(kl, response_mask, mode, **batch_info)
            loss = loss + config.kl_loss_coef * kl_loss
            terms["actor/kl_loss"] = kl_loss.detach()
        return MicroBatchLoss(loss, loss_terms=terms, token_metrics=pg_metrics)


def _temperature(meta_info: dict) -> float:
    if "temperature" not in meta_info:
        raise KeyError("meta_info['temperature'] is missing: log-probs are taken under logits / rollout temperature")
    temperature = float(meta_info["temperature"])
    if temperature <= 0:
        raise ValueError(f"meta_info['temperature'] must be > 0 to score log-probs, got {temperature}")
    return temperature
