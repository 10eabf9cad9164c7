"""The PPO update loop the actor and the critic share: epochs, mini-batches, micro-batches, one optimizer step each.

    rows --(ppo_epochs x [shuffle], split)--> mini-batches, one optimizer step each
    mini-batch --(split)--> micro-batches, one forward/backward each, gradients accumulated

Only the loss differs between the two (the clipped policy loss with entropy and KL terms, the clipped value
loss), so each passes its own `micro_batch_loss` and this module owns the rest.

The loss is invariant to the data-parallel size and to micro-batching: before a mini-batch's
micro-batches run, one all-reduce counts its response tokens and its sequences that have a response
over all ranks (`mini_batch_global_info`), and every micro-batch aggregates its loss by those global
counts times the number of ranks (`agg_loss`'s batch_num_tokens / global_batch_size / dp_size, as
in verl). Summing the micro-batch gradients and FSDP's average over the ranks then give exactly the
gradient of the loss of the whole global mini-batch at once: for token-mean every response token weighs
the same whichever rank or micro-batch holds it, for the seq-mean modes every sequence with a response does.

Micro-batches are either `micro_batch_size` consecutive rows or, with a token budget (`use_dynamic_bsz`),
token-budget groups balanced by length (data/seqlen_balancing.rearrange_micro_batches; the ranks agree on
their number, since FSDP runs collectives in every forward). A forward pass puts the rows back in their
order with the reverse index (`in_row_order`).

A step whose global gradient norm is NaN/inf is skipped on every rank alike (the norm is global);
<role>/grad_norm shows it, and the trainer counts such steps and stops the run after
trainer.max_consecutive_nonfinite_steps in a row (trainer/ppo/nonfinite_guard.py).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from hybridrl.protocol import DataProto
from hybridrl.models.fsdp_utils import clip_grad_norm
from hybridrl.data.seqlen_balancing import get_reverse_idx, rearrange_micro_batches
from hybridrl.workers.out_of_memory import training_memory_error

Rows = dict[str, torch.Tensor]


@dataclass
class MicroBatchLoss:
    """What a role's loss gives back for one micro-batch.

    loss: this micro-batch's share of the global mini-batch's loss (times dp_size); the loop calls backward on it.
    loss_terms: shares of the global loss as well (e.g. actor/pg_loss): summed over the micro-batches.
    token_metrics: token means over this micro-batch (e.g. critic/vpred_mean): weighted by its share of the
    mini-batch's response tokens, so the sum over micro-batches, averaged over the ranks, is the global mean.
    """
    loss: torch.Tensor
    loss_terms: dict[str, float] = field(default_factory=dict)
    token_metrics: dict[str, float] = field(default_factory=dict)


# (micro-batch rows, the mini-batch's global counts from mini_batch_global_info) -> MicroBatchLoss
MicroBatchLossFn = Callable[[Rows, dict[str, float]], MicroBatchLoss]


@dataclass
class PPOUpdateLoop:
    """One role's update settings: `role` names its metrics (<role>/grad_norm) and its config keys in errors.

    mini_batch_size: rows of one rank's mini-batch (`rows_per_rank`); micro_batch_size: rows per forward;
    max_token_len: the token budget per forward that replaces micro_batch_size (None: fixed-size micro-batches).
    memory_remedies: the keys that shrink a micro-batch's memory (workers/out_of_memory.py), named by the error a
    micro-batch that runs out of GPU memory raises.
    """
    role: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    ppo_epochs: int
    shuffle: bool
    grad_clip: float
    mini_batch_size: int
    micro_batch_size: int
    max_token_len: int | None
    memory_remedies: tuple[str, ...] = ()

    def run(self, rows: Rows, micro_batch_loss: MicroBatchLossFn, method: str,
            fixed_metrics: dict[str, float] | None = None) -> dict[str, list[float]]:
        """ppo_epochs passes of mini-batch steps over this rank's rows; metrics averaged over the ranks.

        Each metric holds one value per mini-batch step (in step order): the value over the whole
        mini-batch, then the mean over the data-parallel ranks, so every rank returns the global value.
        fixed_metrics (e.g. actor/kl_coef) are reported with every step as they are.
        """
        num_rows = len(rows["input_ids"])
        if num_rows % self.mini_batch_size:
            raise ValueError(f"{method}: this rank got {num_rows} rows, not a multiple of its mini-batch of "
                             f"{self.mini_batch_size} rows ({self.role}.ppo_mini_batch_size x rollout.n / world size)")
        self.module.train()
        metrics: dict[str, list[float]] = defaultdict(list)
        for _ in range(self.ppo_epochs):
            order = torch.randperm(num_rows) if self.shuffle else torch.arange(num_rows)
            for start in range(0, num_rows, self.mini_batch_size):
                mini_batch = {key: value[order[start:start + self.mini_batch_size]] for key, value in rows.items()}
                step_metrics = self.step(mini_batch, micro_batch_loss)
                step_metrics.update(fixed_metrics or {})
                for key, value in step_metrics.items():
                    metrics[key].append(value)
        return mean_over_ranks(metrics, self.device)

    def step(self, mini_batch: Rows, micro_batch_loss: MicroBatchLossFn) -> dict[str, float]:
        """Accumulate the micro-batch gradients, clip, step (or skip on a non-finite norm). The step's metrics."""
        self.optimizer.zero_grad()
        batch_info = mini_batch_global_info(mini_batch["response_mask"], self.device)
        totals: dict[str, float] = defaultdict(float)
        for micro_batch in micro_batches_of(mini_batch, self.micro_batch_size, self.max_token_len)[0]:
            try:
                result = micro_batch_loss(micro_batch, batch_info)
                result.loss.backward()
            except torch.OutOfMemoryError as error:
                raise training_memory_error(f"{self.role} update", micro_batch, self.device,
                                            self.memory_remedies) from error
            token_share = share_of_global_tokens(micro_batch["response_mask"], batch_info)
            for key, value in result.loss_terms.items():  # already shares of the global loss: they add up
                totals[key] += float(value)
            for key, value in result.token_metrics.items():  # token means of the micro-batch, weighted by its tokens
                totals[key] += float(value) * token_share
        grad_norm = clip_grad_norm(self.module, self.grad_clip)
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.step()
        else:  # every rank sees the same global norm, so every rank skips together
            self.optimizer.zero_grad()
        totals[f"{self.role}/grad_norm"] = grad_norm
        return dict(totals)


# ---------------------------------------------------------------------- batch plumbing (also for forward passes)

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


def take_keys(data: DataProto, keys: list[str], method: str) -> Rows:
    """The named batch tensors; a missing key is an error naming the method and the keys present."""
    missing = [key for key in keys if key not in data.batch]
    if missing:
        raise KeyError(f"{method}: batch lacks key(s) {missing}; it has {sorted(data.batch)}")
    return {key: data.batch[key] for key in keys}


def split_rows(rows: Rows, size: int) -> list[Rows]:
    """Consecutive slices of `size` rows (the last may be shorter)."""
    num_rows = len(next(iter(rows.values())))
    return [{key: value[start:start + size] for key, value in rows.items()} for start in range(0, num_rows, size)]


def micro_batches_of(rows: Rows, micro_batch_size: int | None, max_token_len: int | None
                     ) -> tuple[list[Rows], list[int] | None]:
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
