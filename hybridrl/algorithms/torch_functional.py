"""Small tensor helpers shared by the losses, the actor and the critic.

Masks are "1 = this token counts, 0 = padding / prompt"; they may be bool, int or float and are
cast to the values' dtype. Everything here is plain torch: no I/O, no distributed code.

The two vocabulary-sized helpers (`logprobs_from_logits`, `entropy_from_logits`) walk the rows in
chunks so that at most one chunk is ever upcast to float32: logits of a 150k vocabulary in bf16
are already the largest tensor of a step, and a float32 softmax copy of all of them would double it.
Under autograd that is not enough: each chunk's softmax is kept for the backward pass, so an entropy in the loss
holds a float32 softmax of every token. verl's two memory keys for it are `entropy_function`'s switches:
`entropy_from_logits_with_chunking` (forward and backward both walk the chunks; the graph keeps only the logits)
and `entropy_checkpointing` (the entropy keeps no graph and is recomputed in backward).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

# Elements per float32 working chunk in the vocabulary helpers (2**26 floats = 256 MiB).
_CHUNK_ELEMENTS = 2**26


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set (over all elements when `axis` is None)."""
    masked = values * mask.to(values.dtype)
    return masked.sum() if axis is None else masked.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of `values` over the masked elements; 0 (not NaN) where nothing is masked in.

    An all-padding row or micro-batch must not poison a loss with NaN, so the count is
    clamped away from zero; the sum is then exactly 0 there.
    """
    count = mask.to(values.dtype).sum() if axis is None else mask.to(values.dtype).sum(dim=axis)
    return masked_sum(values, mask, axis) / count.clamp(min=1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the masked elements (Bessel-corrected when `unbiased`)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        if count < 2:
            raise ValueError(f"masked_var(unbiased=True) needs at least 2 masked-in elements, got {count.item():g}")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std over the masked elements; keeps the mean when `shift_mean` is False.

    The 1e-8 under the square root makes a constant input whiten to 0 instead of NaN.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise clamp of `x` into [tensor_min, tensor_max] where the bounds are tensors."""
    return torch.maximum(torch.minimum(x, tensor_max), tensor_min)


def _rows_per_chunk(vocab_size: int) -> int:
    """Rows of `vocab_size` logits in one chunk of at most `_CHUNK_ELEMENTS` (at least one row)."""
    return max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))


def _map_row_chunks(fn, logits: torch.Tensor, rows_per_chunk: int | None = None) -> torch.Tensor:
    """Apply `fn` (float32 rows of logits -> one value per row) chunk by chunk; shaped like logits[..., 0].

    A chunk holds `rows_per_chunk` rows (default: at most `_CHUNK_ELEMENTS` logits); an empty input still makes
    one (empty) chunk.
    """
    vocab_size = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab_size)
    rows_per_chunk = rows_per_chunk or _rows_per_chunk(vocab_size)
    chunks = [fn(flat_logits[start:start + rows_per_chunk].float())
              for start in range(0, max(flat_logits.shape[0], 1), rows_per_chunk)]
    return torch.cat(chunks).reshape(logits.shape[:-1])


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) for logits (..., vocab) and integer labels (...), returned in float32.

    Computed as logit[label] - logsumexp(logits), the logsumexp in float32 one row chunk at a time,
    so no softmax over the vocabulary is ever materialised and bf16 logits keep float32 accuracy.
    """
    label_logits = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1).float()
    return label_logits - _map_row_chunks(lambda rows: rows.logsumexp(dim=-1), logits)


def _entropy_of_rows(rows: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) * z) for each row z."""
    return rows.logsumexp(dim=-1) - (torch.softmax(rows, dim=-1) * rows).sum(dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis, in float32, shaped like logits without it.

    Evaluated per row chunk so only one chunk is upcast at a time (under autograd each chunk's
    softmax is still kept for the backward pass).
    """
    return _map_row_chunks(_entropy_of_rows, logits)


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy whose backward recomputes each chunk's softmax instead of keeping all of them.

    dH/dz = p * (E_p[z] - z) for a row z with p = softmax(z), so backward needs only the logits.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows_per_chunk: int) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.rows_per_chunk = rows_per_chunk
        return _map_row_chunks(_entropy_of_rows, logits, rows_per_chunk)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_entropy: torch.Tensor):
        (logits,) = ctx.saved_tensors
        vocab_size, rows_per_chunk = logits.shape[-1], ctx.rows_per_chunk
        flat_logits, flat_grad = logits.reshape(-1, vocab_size), grad_entropy.reshape(-1, 1).float()
        grad_logits = torch.empty_like(flat_logits)
        for start in range(0, flat_logits.shape[0], rows_per_chunk):
            chunk = slice(start, start + rows_per_chunk)
            rows = flat_logits[chunk].float()
            probs = torch.softmax(rows, dim=-1)
            mean_logit = (probs * rows).sum(dim=-1, keepdim=True)
            grad_logits[chunk] = probs * (mean_logit - rows) * flat_grad[chunk]
        return grad_logits.reshape(logits.shape), None


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """`entropy_from_logits` whose gradient also walks the rows in chunks: the autograd graph keeps the logits
    only, never a softmax of every row (verl's `entropy_from_logits_with_chunking`).

    chunk_size: rows per chunk; None takes the rows of `_CHUNK_ELEMENTS` logits, as the forward-only helpers do.
    """
    rows_per_chunk = chunk_size or _rows_per_chunk(logits.shape[-1])
    return _ChunkedEntropy.apply(logits, rows_per_chunk)


def entropy_function(with_chunking: bool, checkpointing: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The entropy of logits as a policy's config asks for it: verl's `entropy_from_logits_with_chunking` and
    `entropy_checkpointing` keys. Without a gradient both give `entropy_from_logits`' numbers at its cost."""
    entropy = entropy_from_logits_with_chunking if with_chunking else entropy_from_logits
    if not checkpointing:
        return entropy

    def recomputed_in_backward(logits: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return entropy(logits)
        return checkpoint(entropy, logits, use_reentrant=False)

    return recomputed_in_backward
