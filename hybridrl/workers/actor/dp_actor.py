"""The data-parallel PPO actor: log-probs of responses and the policy update, on one rank's share of a batch.

Each rank holds a slice of the batch (the worker group splits it) and an FSDP-sharded model; FSDP
averages gradients over the ranks during backward. Within a rank:

    batch --(ppo_epochs x [shuffle], split)--> mini-batches, one optimizer step each
    mini-batch --(split)--> micro-batches, one forward/backward each, gradients accumulated

The loss is invariant to the data-parallel size and to micro-batching: before a mini-batch's
micro-batches run, one all-reduce counts its response tokens and its sequences that have a response
over all ranks (`mini_batch_global_info`), and every micro-batch aggregates its loss by those global
counts times the number of ranks (`agg_loss`'s batch_num_tokens / global_batch_size / dp_size, as
in verl; the policy loss reads them from `config.global_batch_info`). Summing the micro-batch
gradients and FSDP's average over the ranks then give exactly the gradient of the loss of the whole
global mini-batch at once: for token-mean every response token weighs the same whichever rank or
micro-batch holds it, for the seq-mean modes every sequence with a response does.

Micro-batches are either `ppo_micro_batch_size_per_gpu` consecutive rows or, with `use_dynamic_bsz`,
token-budget groups of at most `ppo_max_token_len_per_gpu` attended tokens, balanced by length
(utils/seqlen_balancing.rearrange_micro_batches; the ranks agree on their number, since FSDP runs
collectives in every forward). The global normalisation above keeps both exact; a
forward pass puts the rows back in their order with the reverse index. With `use_remove_padding`
each micro-batch runs as one packed row of its real tokens (utils/padding.py). With `use_fused_kernels`
the output layer is fused into the log-prob computation, so no full-vocabulary logits are ever held
(utils/fused_logprob.py); it combines with either layout.

Batch keys read: input_ids, attention_mask, position_ids, responses (all passes); response_mask,
old_log_probs, advantages, and ref_log_prob with use_kl_loss (update). meta_info: temperature.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.models.attention import padded_attention_mask
from hybridrl.protocol import DataProto
from hybridrl.algorithms.core_algos import agg_loss, get_policy_loss_fn, kl_penalty
from hybridrl.utils.distributed import device_name
from hybridrl.utils.fsdp_utils import clip_grad_norm
from hybridrl.utils.fused_logprob import response_log_probs_fused
from hybridrl.utils.padding import response_log_probs_packed
from hybridrl.utils.seqlen_balancing import get_reverse_idx, rearrange_micro_batches
from hybridrl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

FORWARD_KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]


class DataParallelPPOActor:
    def __init__(self, config: Any, actor_module: nn.Module, actor_optimizer: torch.optim.Optimizer | None = None, *,
                 rollout_n: int | None = None, log_prob_micro_batch_size: int | None = None,
                 log_prob_max_token_len: int | None = None, use_remove_padding: bool = False,
                 use_fused_kernels: bool = False, device: str | None = None):
        """`config` is the actor section (or the ref section for a frozen reference, no optimizer).

        rollout_n (required with an optimizer): responses per prompt; `ppo_mini_batch_size` counts
        prompts, so a rank's mini-batch holds ppo_mini_batch_size * rollout_n / world_size rows.
        log_prob_micro_batch_size: rows per forward in compute_log_prob; log_prob_max_token_len
        (dynamic batch size) replaces it by a token budget per forward. The worker resolves both from
        the rollout/ref config. use_remove_padding: `model.use_remove_padding` (packed forwards).
        use_fused_kernels: `model.use_fused_kernels` (log-probs fused with the output layer).
        """
        self.config = config
        self.actor_module = actor_module
        self.actor_optimizer = actor_optimizer
        self.device = torch.device(device or device_name())
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        self.log_prob_max_token_len = log_prob_max_token_len
        self.use_remove_padding = use_remove_padding
        self.use_fused_kernels = use_fused_kernels
        if actor_optimizer is not None:
            if rollout_n is None:
                raise ValueError("DataParallelPPOActor with an optimizer needs rollout_n (actor_rollout_ref.rollout.n)")
            self.mini_batch_size = rows_per_rank(config.ppo_mini_batch_size, rollout_n, "actor.ppo_mini_batch_size")
            self.micro_batch_size = config.ppo_micro_batch_size_per_gpu
            self.max_token_len = config.ppo_max_token_len_per_gpu if config.use_dynamic_bsz else None
            self.policy_loss_fn = get_policy_loss_fn(config.policy_loss.loss_mode)

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
        if self.use_remove_padding:  # packed: 0 (not arbitrary numbers) at response padding; both are masked
            inputs = [micro_batch[key].to(self.device) for key in FORWARD_KEYS]
            return response_log_probs_packed(self.actor_module, *inputs, temperature, calculate_entropy, entropy_grad)
        response_length = micro_batch["responses"].shape[1]
        output = self.actor_module(input_ids=micro_batch["input_ids"].to(self.device),
                                   attention_mask=padded_attention_mask(micro_batch["attention_mask"].to(self.device)),
                                   position_ids=micro_batch["position_ids"].to(self.device), use_cache=False)
        logits = output.logits[:, -response_length - 1:-1, :] / temperature
        log_probs = logprobs_from_logits(logits, micro_batch["responses"].to(self.device))
        if not calculate_entropy:
            return log_probs, None
        if entropy_grad:
            return log_probs, entropy_from_logits(logits)
        with torch.no_grad():
            return log_probs, entropy_from_logits(logits.detach())

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
                log_prob, entropy = self._forward_micro_batch(micro_batch, temperature, calculate_entropy)
                log_probs.append(log_prob.cpu())
                entropies.append(entropy.cpu() if calculate_entropy else None)
        log_prob = in_row_order(torch.cat(log_probs), order)
        return log_prob, (in_row_order(torch.cat(entropies), order) if calculate_entropy else None)

    # ------------------------------------------------------------------ update
    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """ppo_epochs passes of mini-batch steps over this rank's rows; metrics averaged over the ranks.

        Each metric holds one value per mini-batch step (in step order): the value over the whole
        mini-batch, then the mean over the data-parallel ranks, so every rank returns the global value.
        """
        if self.actor_optimizer is None:
            raise RuntimeError("update_policy on an actor without optimizer (a reference policy is frozen)")
        keys = FORWARD_KEYS + ["response_mask", "old_log_probs", "advantages"]
        keys += ["ref_log_prob"] if self.config.use_kl_loss else []
        rows = take_keys(data, keys, "update_policy")
        temperature = _temperature(data.meta_info)
        num_rows = len(rows["input_ids"])
        if num_rows % self.mini_batch_size:
            raise ValueError(f"update_policy: this rank got {num_rows} rows, not a multiple of its mini-batch of "
                             f"{self.mini_batch_size} rows (actor.ppo_mini_batch_size x rollout.n / world size)")
        self.actor_module.train()
        metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.config.ppo_epochs):
            order = torch.randperm(num_rows) if self.config.shuffle else torch.arange(num_rows)
            for start in range(0, num_rows, self.mini_batch_size):
                mini_batch = {key: value[order[start:start + self.mini_batch_size]] for key, value in rows.items()}
                for key, value in self._update_mini_batch(mini_batch, temperature).items():
                    metrics[key].append(value)
        return mean_over_ranks(metrics, self.device)

    def _update_mini_batch(self, mini_batch: dict[str, torch.Tensor], temperature: float) -> dict[str, float]:
        """Accumulate the micro-batch gradients, clip, step. Returns the mini-batch's metrics.

        A step whose global gradient norm is NaN/inf is skipped on every rank alike (the norm is global);
        actor/grad_norm shows it, and the trainer counts such steps and stops the run after
        trainer.max_consecutive_nonfinite_steps in a row (trainer/ppo/nonfinite_guard.py).
        """
        self.actor_optimizer.zero_grad()
        batch_info = mini_batch_global_info(mini_batch["response_mask"], self.device)
        self.config.global_batch_info = batch_info  # what the policy loss aggregates by (losses.global_batch_info)
        totals: dict[str, float] = defaultdict(float)
        for micro_batch in micro_batches_of(mini_batch, self.micro_batch_size, self.max_token_len)[0]:
            loss, loss_terms, token_metrics = self._micro_batch_loss(micro_batch, temperature, batch_info)
            loss.backward()
            token_share = share_of_global_tokens(micro_batch["response_mask"], batch_info)
            for key, value in loss_terms.items():  # already shares of the global loss: they add up
                totals[key] += float(value)
            for key, value in token_metrics.items():  # token means of the micro-batch, weighted by its tokens
                totals[key] += float(value) * token_share
        grad_norm = clip_grad_norm(self.actor_module, self.config.grad_clip)
        if torch.isfinite(torch.tensor(grad_norm)):
            self.actor_optimizer.step()
        else:  # every rank sees the same global norm, so every rank skips together
            self.actor_optimizer.zero_grad()
        totals["actor/grad_norm"] = grad_norm
        if self.config.use_kl_loss:
            totals["actor/kl_coef"] = float(self.config.kl_loss_coef)
        return dict(totals)

    def _micro_batch_loss(self, micro_batch: dict[str, torch.Tensor], temperature: float,
                          batch_info: dict[str, float]
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        """(loss, its aggregated terms, token-mean metrics of the policy loss) for one micro-batch; the loss
        and its terms are this micro-batch's share of the global mini-batch's loss (times dp_size)."""
        config, mode = self.config, self.config.loss_agg_mode
        entropy_in_loss = config.entropy_coeff != 0  # else the entropy is only reported
        log_prob, entropy = self._forward_micro_batch(micro_batch, temperature, calculate_entropy=True,
                                                      entropy_grad=entropy_in_loss)
        response_mask = micro_batch["response_mask"].to(self.device)
        pg_loss, pg_metrics = self.policy_loss_fn(
            old_log_prob=micro_batch["old_log_probs"].to(self.device), log_prob=log_prob,
            advantages=micro_batch["advantages"].to(self.device), response_mask=response_mask,
            loss_agg_mode=mode, config=config)
        entropy_loss = agg_loss(entropy, response_mask, mode, **batch_info)
        loss = pg_loss - config.entropy_coeff * entropy_loss if entropy_in_loss else pg_loss
        terms = {"actor/pg_loss": pg_loss.detach(), "actor/entropy": entropy_loss.detach()}
        if config.use_kl_loss:
            kl = kl_penalty(log_prob, micro_batch["ref_log_prob"].to(self.device), config.kl_loss_type)
            kl_loss = agg_loss(kl, response_mask, mode, **batch_info)
            loss = loss + config.kl_loss_coef * kl_loss
            terms["actor/kl_loss"] = kl_loss.detach()
        return loss, terms, pg_metrics


# ---------------------------------------------------------------------- helpers shared with the critic

def rows_per_rank(mini_batch_prompts: int, rollout_n: int, key: str) -> int:
    """Rows of one rank's mini-batch: prompts x responses per prompt / data-parallel ranks."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rows = mini_batch_prompts * rollout_n
    if rows % world_size:
        raise ValueError(f"{key}={mini_batch_prompts} x rollout.n={rollout_n} = {rows} rows do not split over "
                         f"{world_size} ranks")
    return rows // world_size


def mini_batch_global_info(response_mask: torch.Tensor, device: torch.device) -> dict[str, float]:
    """agg_loss's global counts for the mini-batch that all data-parallel ranks step on together.

    dp_size: the number of ranks; batch_num_tokens: response tokens on all ranks; global_batch_size:
    sequences with at least one response token on all ranks (fully-masked rows are in no mean).
    One all-reduce; every rank must call it for every mini-batch.
    """
    counts = torch.stack([response_mask.sum(), (response_mask.sum(dim=-1) > 0).sum()]).to(device, torch.float64)
    dp_size = dist.get_world_size() if dist.is_initialized() else 1
    if dp_size > 1:
        dist.all_reduce(counts)
    tokens, sequences = counts.tolist()
    return {"dp_size": dp_size, "batch_num_tokens": tokens, "global_batch_size": sequences}


def share_of_global_tokens(response_mask: torch.Tensor, batch_info: dict[str, float]) -> float:
    """This micro-batch's response tokens / the global mini-batch's, times dp_size: the weight that makes a
    token-mean metric summed over micro-batches, then averaged over the ranks, the global token mean."""
    return float(response_mask.sum()) / max(batch_info["batch_num_tokens"], 1) * batch_info["dp_size"]


def mean_over_ranks(metrics: dict[str, list[float]], device: torch.device) -> dict[str, list[float]]:
    """Element-wise mean of each metric list over the data-parallel ranks (one all-reduce for all)."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    lengths = [len(metrics[key]) for key in keys]
    flat = torch.tensor([value for key in keys for value in metrics[key]], dtype=torch.float64, device=device)
    dist.all_reduce(flat)
    flat = (flat / dist.get_world_size()).tolist()
    averaged, start = {}, 0
    for key, length in zip(keys, lengths):
        averaged[key] = flat[start:start + length]
        start += length
    return averaged


def _temperature(meta_info: dict) -> float:
    if "temperature" not in meta_info:
        raise KeyError("meta_info['temperature'] is missing: log-probs are taken under logits / rollout temperature")
    temperature = float(meta_info["temperature"])
    if temperature <= 0:
        raise ValueError(f"meta_info['temperature'] must be > 0 to score log-probs, got {temperature}")
    return temperature


def take_keys(data: DataProto, keys: list[str], method: str) -> dict[str, torch.Tensor]:
    """The named batch tensors; a missing key is an error naming the method and the keys present."""
    missing = [key for key in keys if key not in data.batch]
    if missing:
        raise KeyError(f"{method}: batch lacks key(s) {missing}; it has {sorted(data.batch)}")
    return {key: data.batch[key] for key in keys}


def split_rows(rows: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive slices of `size` rows (the last may be shorter)."""
    num_rows = len(next(iter(rows.values())))
    return [{key: value[start:start + size] for key, value in rows.items()} for start in range(0, num_rows, size)]


def micro_batches_of(rows: dict[str, torch.Tensor], micro_batch_size: int | None, max_token_len: int | None
                     ) -> tuple[list[dict[str, torch.Tensor]], list[int] | None]:
    """(micro-batches, the flat row order they hold, or None when that is the original order).

    max_token_len None: consecutive slices of micro_batch_size rows. Otherwise token-budget groups
    (dynamic batch size, see rearrange_micro_batches); every data-parallel rank must call this in step.
    """
    if max_token_len is None:
        return split_rows(rows, micro_batch_size), None
    micro_batches, partitions = rearrange_micro_batches(DataProto.from_dict(rows), max_token_len)
    return [micro_batch.batch for micro_batch in micro_batches], [row for group in partitions for row in group]


def in_row_order(outputs: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """Outputs computed in `order` (from micro_batches_of), put back in the rows' original order."""
    return outputs if order is None else outputs[get_reverse_idx(order)]
