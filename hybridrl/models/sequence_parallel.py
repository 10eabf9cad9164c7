"""Ulysses sequence parallelism (DeepSpeed-Ulysses, verl's `ulysses_sequence_parallel_size`): P ranks share the
tokens of one packed forward, each holding 1/P of them through every layer.

Groups: with size P, ranks 0..P-1, P..2P-1, ... each form one sequence-parallel group (`sequence_parallel_group`).

Data: every rank keeps its own rows, exactly as without sequence parallelism (the worker group's split, the loss
normalised over all ranks, FSDP's average over all ranks: workers/ppo_update_loop.py). For each micro-batch the group
packs the micro-batches of its P ranks into one row (models/padding.py), one after another, and each rank runs the
model on its 1/P slice of that row (`response_log_probs_sequence_parallel`). The per-token log-probs (and entropies)
are computed on each slice and gathered back along the sequence; every rank reads its own rows' tokens from the
gathered row. The gradient of every rank's loss reaches the slices that computed its tokens (the gather's backward
sums the ranks' gradients), so summed over the ranks it is the gradient without sequence parallelism, and FSDP's
average over the ranks is unchanged. Per rank this holds about as many tokens as its own micro-batch, and one
sequence may be longer than a rank could hold alone. (verl instead gives the P ranks of a group the same
micro-batches, 1/P of the tokens each, with a data-parallel size of world/P; the gradients are the same.)

Attention: the only layer that mixes tokens. `ulysses_attention` is registered with transformers'
AttentionInterface around the model's own kernel (sdpa on the CPU, a varlen kernel on CUDA: models/attention.py).
Inside a sequence-parallel forward it turns the (all heads, own 1/P of the sequence) query, key and value into
(1/P of the heads, whole sequence) with one all-to-all, runs the kernel over the whole packed row (each sequence
attends only to itself: the boundaries come with the call), and turns the output back with a second all-to-all.
Any other call (generation, a forward without a group) goes to the kernel unchanged. P must divide the attention
heads and the key/value heads (config check: models/config_checks.py).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from hybridrl.algorithms.torch_functional import entropy_from_logits, logprobs_from_logits
from hybridrl.models.attention import VARLEN, cu_seqlens_from_positions
from hybridrl.models.padding import response_scoring_rows, unpad_input

PREFIX = "ulysses_"
# The kernels models/attention.py loads a model with: sdpa takes a dense mask of the whole row, the varlen ones its
# sequence boundaries.
KERNELS = ("sdpa", "flash_attention_2", VARLEN)


class SequenceParallel(NamedTuple):
    """What the attention layers of one sequence-parallel forward need: the group and the whole packed row's
    boundaries and positions (each rank's model sees only its slice)."""

    group: dist.ProcessGroup
    cu_seqlens: torch.Tensor  # (sequences + 1,) int32 boundaries in the whole packed row
    max_seqlen: int
    position_ids: torch.Tensor  # (1, whole row) positions, restarting at 0 for every sequence


@functools.cache
def sequence_parallel_group(size: int) -> dist.ProcessGroup:
    """This rank's group of `size` consecutive ranks (every rank creates every group, in order, as torch needs)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % size:
        raise ValueError(f"ulysses_sequence_parallel_size={size} does not divide the world size {world_size}")
    groups = [dist.new_group(list(range(start, start + size))) for start in range(0, world_size, size)]
    return groups[rank // size]


def use_ulysses_attention(model: nn.Module) -> None:
    """Route `model`'s attention through `ulysses_attention` around the kernel it was loaded with."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    kernel_name = model.config._attn_implementation
    if kernel_name.startswith(PREFIX):
        return
    if kernel_name not in KERNELS:
        raise ValueError(f"ulysses_sequence_parallel_size > 1: expected a model loaded with one of {KERNELS}, got "
                         f"attn_implementation {kernel_name!r}")
    name = PREFIX + kernel_name
    AttentionInterface.register(name, functools.partial(ulysses_attention, kernel_name=kernel_name))
    # calls outside a sequence-parallel forward (generation with padding) get the kernel's own mask
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[kernel_name])
    model.set_attn_implementation(name)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, *, kernel_name: str,
                      sequence_parallel: SequenceParallel | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: (1, heads, own tokens, dim) q/k/v -> ((1, own tokens, heads, dim), None)."""
    from transformers import AttentionInterface

    kernel = AttentionInterface._global_mapping[kernel_name]
    if sequence_parallel is None:
        return kernel(module, query, key, value, attention_mask, **kwargs)
    group = sequence_parallel.group
    query, key, value = (_heads_to_sequence(tensor, group) for tensor in (query, key, value))
    kwargs.update(position_ids=sequence_parallel.position_ids, cu_seq_lens_q=sequence_parallel.cu_seqlens,
                  cu_seq_lens_k=sequence_parallel.cu_seqlens, max_length_q=sequence_parallel.max_seqlen,
                  max_length_k=sequence_parallel.max_seqlen)
    # varlen kernels read the boundaries and want no mask; sdpa gets the block-diagonal causal mask
    mask = _packed_causal_mask(sequence_parallel) if kernel_name == "sdpa" else None
    output, _ = kernel(module, query, key, value, mask, **kwargs)
    return _sequence_to_heads(output, group), None


def _heads_to_sequence(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(1, heads, own tokens, dim) -> (1, heads / P, all tokens, dim): rank j receives head block j of every slice."""
    size = dist.get_world_size(group)
    _, heads, tokens, dim = tensor.shape
    blocks = tensor.reshape(size, heads // size, tokens, dim).contiguous()
    received = all_to_all_single_autograd(blocks, None, None, group)  # block i: slice i of the sequence
    return received.transpose(0, 1).reshape(1, heads // size, size * tokens, dim)


def _sequence_to_heads(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(1, all tokens, heads / P, dim) -> (1, own tokens, heads, dim): the inverse of `_heads_to_sequence` for the
    attention output (transformers' kernels return tokens before heads)."""
    size = dist.get_world_size(group)
    _, all_tokens, heads, dim = tensor.shape
    blocks = tensor.reshape(size, all_tokens // size, heads, dim).contiguous()
    received = all_to_all_single_autograd(blocks, None, None, group)  # block i: head block i
    return received.permute(1, 0, 2, 3).reshape(1, all_tokens // size, size * heads, dim)


def _packed_causal_mask(sequence_parallel: SequenceParallel) -> torch.Tensor:
    """(1, 1, all, all) bool: causal attention within each sequence of the whole packed row."""
    cu_seqlens = sequence_parallel.cu_seqlens
    tokens = int(cu_seqlens[-1])
    positions = torch.arange(tokens, device=cu_seqlens.device)
    sequence = torch.bucketize(positions, cu_seqlens[1:].long(), right=True)
    mask = (sequence[:, None] == sequence[None, :]) & (positions[None, :] <= positions[:, None])
    return mask[None, None]


class _GatherSequence(torch.autograd.Function):
    """All-gather of equal (tokens,) slices along the sequence; backward gives each slice the sum over the ranks of
    the gradient at its tokens (every rank's loss may read any slice)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.tokens = group, dist.get_rank(group), local.shape[0]
        slices = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(slices, local.contiguous(), group=group)
        return torch.cat(slices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.tokens:(ctx.rank + 1) * ctx.tokens], None


def _gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list[int]]:
    """The group's (1, n_i) packed rows one after another, and each rank's n_i (no gradient: token ids)."""
    length = torch.tensor([tensor.shape[1]], device=tensor.device)
    lengths = [torch.empty_like(length) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, length, group=group)
    lengths = [int(n) for n in lengths]
    padded = torch.zeros(1, max(lengths), dtype=tensor.dtype, device=tensor.device)
    padded[:, :tensor.shape[1]] = tensor
    rows = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(rows, padded, group=group)
    return torch.cat([row[:, :n] for row, n in zip(rows, lengths)], dim=1), lengths


def response_log_probs_sequence_parallel(
        model: nn.Module, group: dist.ProcessGroup, input_ids: torch.Tensor, attention_mask: torch.Tensor,
        position_ids: torch.Tensor, responses: torch.Tensor, temperature: float, calculate_entropy: bool = False,
        entropy_grad: bool = False, entropy_fn: Callable[[torch.Tensor], torch.Tensor] = entropy_from_logits
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """models/padding.response_log_probs_packed with the group's micro-batches packed into one row and each rank
    running 1/P of it; every rank of `group` calls it together and gets its own rows' (rows, R) results."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    own = unpad_input(input_ids, attention_mask, position_ids)
    ids, lengths = _gather_rows(own.input_ids, group)
    positions, _ = _gather_rows(own.position_ids, group)
    padding = -ids.shape[1] % size  # a last "sequence" of padding tokens evens the slices; its outputs are unread
    ids = torch.cat([ids, torch.zeros(1, padding, dtype=ids.dtype, device=ids.device)], dim=1)
    positions = torch.cat([positions, torch.arange(padding, device=ids.device)[None]], dim=1)
    cu_seqlens = cu_seqlens_from_positions(positions[0])
    parallel = SequenceParallel(group, cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), positions)
    tokens = ids.shape[1] // size
    local = slice(rank * tokens, (rank + 1) * tokens)
    logits = model(input_ids=ids[:, local], position_ids=positions[:, local], attention_mask=None, use_cache=False,
                   sequence_parallel=parallel).logits[0] / temperature
    next_tokens = torch.roll(ids[0], -1)[local]  # the logit at a position scores the token after it
    own_tokens = slice(sum(lengths[:rank]), sum(lengths[:rank + 1]))
    scoring_rows, response_attended = response_scoring_rows(attention_mask, responses.shape[1])

    def own_responses(per_token: torch.Tensor) -> torch.Tensor:
        result = torch.zeros(responses.shape, dtype=torch.float32, device=logits.device)
        result[response_attended] = _GatherSequence.apply(per_token, group)[own_tokens][scoring_rows]
        return result

    log_probs = own_responses(logprobs_from_logits(logits, next_tokens))
    if not calculate_entropy:
        return log_probs, None
    if entropy_grad:
        return log_probs, own_responses(entropy_fn(logits))
    with torch.no_grad():
        return log_probs, own_responses(entropy_fn(logits.detach()))
