"""Split rows into groups of near-equal token counts.

Two callers need the same thing, "these rows, k groups, as equal in tokens as possible":

- the trainer (`trainer.balance_batch`): before a batch is dispatched, reorder its rows so that
  each data-parallel rank's contiguous chunk holds the same number of tokens (equal row counts,
  because DP_COMPUTE_PROTO splits the batch into equal chunks). A rank with more tokens makes
  every other rank wait at the next collective.
- the workers (`use_dynamic_bsz`): cut a mini-batch into micro-batches by a token budget
  (`*_max_token_len_per_gpu`) rather than by a row count, so short answers share a forward and
  long ones do not overflow memory.

The grouping is the Karmarkar–Karp largest differencing method for k-way partitioning. Its
worst case for the largest group sum is 4/3 - 1/(3k) times the optimum (Michiels, Korst, Aarts,
van Leeuwen, 2007) and, with equal group sizes, 2 - 1/k (Michiels et al., 2003); on real batches
it is usually within a few tokens of perfect.

A row's length is the number of tokens it attends to, `attention_mask.sum(-1)`: that is what a
packed (remove-padding) forward computes, and what the FLOPs of a padded forward's useful part are.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.protocol import DataProto

__all__ = ["karmarkar_karp", "get_seqlen_balanced_partitions", "rearrange_micro_batches", "get_reverse_idx",
           "balance_batch", "seqlens_of"]


# --------------------------------------------------------------------------------------------------
# the partitioning algorithm


@dataclass
class _PartialSolution:
    """k groups of item indices with their sums, kept ordered from the largest group to the smallest.

    Ties in sum are broken by item count (more items first), so that merging two solutions never
    leaves a group empty while another holds only zero-length items.
    """

    groups: list[list[int]]
    sums: list[int]

    @property
    def spread(self) -> int:
        return self.sums[0] - self.sums[-1]

    @classmethod
    def ordered(cls, groups: list[list[int]], sums: list[int]) -> _PartialSolution:
        order = sorted(range(len(groups)), key=lambda g: (sums[g], len(groups[g])), reverse=True)
        return cls([groups[g] for g in order], [sums[g] for g in order])

    def merge(self, other: _PartialSolution) -> _PartialSolution:
        """Join self's largest group with other's smallest, and so on: the two spreads cancel."""
        paired = list(zip(range(len(self.groups)), reversed(range(len(other.groups)))))
        return _PartialSolution.ordered([self.groups[a] + other.groups[b] for a, b in paired],
                                        [self.sums[a] + other.sums[b] for a, b in paired])


def _initial_solutions(seqlens: list[int], k: int, equal_size: bool) -> list[_PartialSolution]:
    """One partial solution per item, or (equal_size) one per run of k consecutive items by length.

    With equal_size every partial solution holds one item in each group, and merging keeps group
    sizes equal, so the final groups hold len(seqlens) / k items each.
    """
    if not equal_size:
        return [_PartialSolution([[item]] + [[] for _ in range(k - 1)], [length] + [0] * (k - 1))
                for item, length in enumerate(seqlens)]
    by_length = sorted(range(len(seqlens)), key=lambda item: seqlens[item], reverse=True)
    runs = [by_length[start:start + k] for start in range(0, len(by_length), k)]
    return [_PartialSolution.ordered([[item] for item in run], [seqlens[item] for item in run]) for run in runs]


def karmarkar_karp(seqlens: list[int], k: int, equal_size: bool) -> list[list[int]]:
    """Partition item indices 0..n-1 into k groups whose summed `seqlens` are nearly equal.

    Largest differencing: repeatedly take the two partial solutions with the largest spread
    (largest minus smallest group sum) and merge them so their imbalances cancel. equal_size asks
    for n / k items in every group (n must divide by k). Groups are returned largest sum first;
    a group is empty only when there are fewer items than groups.
    """
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be a positive number of groups, got {k}")
    if not seqlens:
        raise ValueError("karmarkar_karp: needs at least one item")
    if equal_size and len(seqlens) % k:
        raise ValueError(f"karmarkar_karp: equal_size needs the item count to divide by k; got {len(seqlens)} "
                         f"items and k={k}")
    arrival = itertools.count()  # ties in spread go first-in first-out, so the result is deterministic
    heap = [(-solution.spread, next(arrival), solution) for solution in _initial_solutions(seqlens, k, equal_size)]
    heapq.heapify(heap)
    while len(heap) > 1:
        first = heapq.heappop(heap)[2]
        second = heapq.heappop(heap)[2]
        merged = first.merge(second)
        heapq.heappush(heap, (-merged.spread, next(arrival), merged))
    return heap[0][2].groups


def get_seqlen_balanced_partitions(seqlens: list[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """k_partitions non-empty groups of row indices with near-equal token sums, each group sorted.

    Groups come in the order of their smallest row index, so the same lengths always give the
    same layout.
    """
    if not 1 <= k_partitions <= len(seqlens):
        raise ValueError(f"get_seqlen_balanced_partitions: cannot make {k_partitions} non-empty partitions of "
                         f"{len(seqlens)} rows")
    if any(length < 0 for length in seqlens):
        raise ValueError(f"get_seqlen_balanced_partitions: sequence lengths must be >= 0, got {min(seqlens)}")
    groups = [sorted(group) for group in karmarkar_karp(seqlens, k_partitions, equal_size)]
    return sorted(groups, key=lambda group: group[0])


# --------------------------------------------------------------------------------------------------
# dynamic batch size: token-budget micro-batches


def seqlens_of(data: DataProto) -> list[int]:
    """Tokens each row attends to (attention_mask.sum(-1)), the length every balancing here uses."""
    if "attention_mask" not in data.batch:
        raise KeyError(f"sequence balancing needs batch['attention_mask']; the batch has {sorted(data.batch)}")
    return data.batch["attention_mask"].sum(dim=-1).tolist()


def _partitions_within_budget(seqlens: list[int], count: int, max_token_len: int) -> list[list[int]] | None:
    partitions = get_seqlen_balanced_partitions(seqlens, count, equal_size=False)
    fits = all(sum(seqlens[row] for row in partition) <= max_token_len for partition in partitions)
    return partitions if fits else None


def _max_over_ranks(value: int, dp_group) -> int:
    if not dist.is_initialized():
        return value
    device = "cuda" if dist.get_backend(dp_group) == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=dp_group)
    return int(tensor.item())


def rearrange_micro_batches(data: DataProto, max_token_len: int, same_micro_num_in_dp: bool = True,
                            dp_group=None) -> tuple[list[DataProto], list[list[int]]]:
    """Cut `data` into micro-batches of at most `max_token_len` attended tokens each.

    The count starts at ceil(total tokens / max_token_len) and grows until the balanced partition
    fits the budget. With same_micro_num_in_dp (and torch.distributed initialised) the ranks of
    `dp_group` agree on the largest count: FSDP runs collectives in every forward and backward, so
    a rank with one micro-batch fewer would hang the others. Returns the micro-batches and, for each,
    the rows of `data` it holds; `get_reverse_idx` turns those into the order that undoes the cut.
    """
    if max_token_len <= 0:
        raise ValueError(f"rearrange_micro_batches: max_token_len must be a positive token count, got {max_token_len}")
    seqlens = seqlens_of(data)
    if not seqlens:
        raise ValueError("rearrange_micro_batches: the batch has no rows")
    longest = max(seqlens)
    if longest > max_token_len:
        raise ValueError(f"rearrange_micro_batches: a sequence of {longest} tokens (row {seqlens.index(longest)}) "
                         f"exceeds the token budget max_token_len={max_token_len}; raise the "
                         f"*_max_token_len_per_gpu setting to at least {longest}")
    agree = same_micro_num_in_dp and dist.is_initialized()
    count = max(1, math.ceil(sum(seqlens) / max_token_len))
    count = _max_over_ranks(count, dp_group) if agree else count
    while True:
        if count > len(seqlens):
            raise ValueError(f"rearrange_micro_batches: the data-parallel ranks agreed on {count} micro-batches but "
                             f"this rank has only {len(seqlens)} rows; give every rank the same rows per mini-batch")
        partitions = _partitions_within_budget(seqlens, count, max_token_len)
        # Every rank takes part in each round, so all of them leave the loop on the same count.
        needed = count if partitions is not None else count + 1
        needed = _max_over_ranks(needed, dp_group) if agree else needed
        if needed == count:
            break
        count = needed
    return [data[partition] for partition in partitions], partitions


def get_reverse_idx(indices: list[int]) -> list[int]:
    """The inverse permutation: `torch.cat(outputs)[get_reverse_idx(flat)]` restores the original row order.

    `indices` is the flat row order the outputs were computed in, i.e. the micro-batches' row lists
    from rearrange_micro_batches joined together.
    """
    if sorted(indices) != list(range(len(indices))):
        raise ValueError(f"get_reverse_idx: indices must be a permutation of 0..{len(indices) - 1}, got {indices}")
    reverse = [0] * len(indices)
    for position, row in enumerate(indices):
        reverse[row] = position
    return reverse


# --------------------------------------------------------------------------------------------------
# trainer.balance_batch


def _chunk_token_sums(seqlens: list[int], world_size: int) -> list[int]:
    chunk = len(seqlens) // world_size
    return [sum(seqlens[rank * chunk:(rank + 1) * chunk]) for rank in range(world_size)]


def _imbalance(token_sums: list[int]) -> float:
    """How much more the busiest rank works than the average one: max / mean - 1 (0 = perfectly even)."""
    mean = sum(token_sums) / len(token_sums)
    return max(token_sums) / mean - 1.0 if mean > 0 else 0.0


def balance_batch(data: DataProto, world_size: int) -> dict[str, float]:
    """Reorder `data`'s rows in place so each rank's contiguous chunk holds near-equal tokens; return metrics.

    Every chunk keeps len(data) / world_size rows (the dispatch splits into equal chunks). The rows
    are only moved when that lowers the busiest rank's tokens, so balancing never makes it worse. Metrics:
    seqlen_balance/min_partition and /max_partition are the fewest and most tokens any rank gets after
    balancing; /imbalance_before and /imbalance_after are max / mean - 1 of the ranks' tokens before and
    after, i.e. the busiest rank's extra work.
    """
    if world_size < 1 or len(data) % world_size:
        raise ValueError(f"balance_batch: {len(data)} rows do not split into {world_size} equal data-parallel chunks; "
                         f"make the batch size a multiple of the number of ranks")
    seqlens = seqlens_of(data)
    before = _chunk_token_sums(seqlens, world_size)
    partitions = get_seqlen_balanced_partitions(seqlens, world_size, equal_size=True)
    after = [sum(seqlens[row] for row in partition) for partition in partitions]
    if max(after) < max(before):  # the arrival order can already be as good; then it stays
        data.reorder([row for partition in partitions for row in partition])
    else:
        after = before
    return {"seqlen_balance/min_partition": float(min(after)),
            "seqlen_balance/max_partition": float(max(after)),
            "seqlen_balance/imbalance_before": _imbalance(before),
            "seqlen_balance/imbalance_after": _imbalance(after)}
