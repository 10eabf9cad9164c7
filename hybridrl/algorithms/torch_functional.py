"""Small tensor helpers shared by the losses, the actor and the critic.

Masks are "1 = this token counts, 0 = padding / prompt"; they may be bool, int or float and are
cast to the values' dtype. Everything here is plain torch: no I/O, no distributed code.

The two vocabulary-sized helpers (`logprobs_from_logits`, `entropy_from_logits`) walk the rows in
chunks so that at most one chunk is ever upcast to float32: logits of a 150k vocabulary in bf16
are already the largest tensor of a step, and a float32 softmax copy of all of them would double it.
"""
from __future__ import annotations

import torch

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


def _map_row_chunks(fn, logits: torch.Tensor) -> torch.Tensor:
    """Apply `fn` (float32 rows of logits -> one value per row) chunk by chunk; shaped like logits[..., 0].

    A chunk holds at most `_CHUNK_ELEMENTS` logits; an empty input still makes one (empty) chunk.
    """
    vocab_size = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab_size)
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(vocab_size, 1))
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
