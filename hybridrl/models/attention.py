"""Attention for the trainer's two batch layouts: padded rows (a NaN-safe mask) and packed rows (varlen kernels).

Padded rows: `padded_attention_mask`
-----------------------------------
A rollout batch is left-padded prompts followed by right-padded responses. transformers turns the
2-D padding mask into "causal AND key is a real token", so a left-padding query attends to nothing:
its attention row is fully masked. The forward returns finite numbers there (softmax over an empty
row is 0 in every SDPA backend), but on an H100 (torch 2.11, cuDNN SDPA, which torch picked for these
bf16 calls with a boolean mask) the *backward* of a fully-masked row returns NaN
(`ScaledDotProductCudnnAttentionBackward0 returned nan values`, found with anomaly detection). Those
rows carry zero loss, yet the NaN reaches every weight gradient through the following matmuls
(0 x NaN = NaN), so every step's grad norm was NaN and every update was skipped.
`padded_attention_mask` builds the 4-D mask itself and lets a query with no key attend to itself:
no row is empty, every other row is exactly transformers' mask, and no backend can produce the NaN. The actor's and the critic's padded forwards use it (SFT batches are right-padded: no empty row).

Packed rows: variable-length attention
--------------------------------------

With `use_remove_padding` a micro-batch runs as ONE row of all its real tokens, the sequences one
after another (models/padding.py). Attention must then stay inside each sequence. transformers'
`sdpa` does that with a dense block-diagonal boolean mask of nnz x nnz: at 16k tokens that is a
256 MiB mask per layer call plus a masked (not flash) kernel whose time and memory grow with the
square of the micro-batch's tokens. Measured on an H100 (benchmarks/README.md, "attention"), that is
what made remove-padding slower than padding and what OOM-ed the engine's resume at 16k tokens.

Here the packed row goes to a flash-attention varlen kernel with the sequence boundaries
(`cu_seqlens`), which skips every cross-sequence block, so time follows the sum of the squared
sequence lengths and memory the token count:
- the flash-attn package's `flash_attention_2` when it is installed (transformers drives it and
  finds the boundaries where position_ids return to 0);
- otherwise `hybridrl_varlen`, registered here with transformers' AttentionInterface: PyTorch's
  own flash-attention varlen kernel (`torch.nn.attention.varlen.varlen_attn`, in torch since 2.9),
  so a GPU host needs no extra package for it.
On CPU (no flash kernels) the model keeps `sdpa`; the packed rows of CPU tests are short.

`hybridrl_varlen` handles only what the trainer sends it packed: one row, no 2-D mask, no KV cache
(query length == key length). Any other call (HF generate with padding or a cache) falls through to
sdpa with the mask transformers built for it (the mask function registered beside it is sdpa's,
except that a packed call gets none).
"""
from __future__ import annotations

import functools
import inspect
from importlib.util import find_spec

import torch


def padded_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(rows, 1, seqlen, seqlen) bool for sdpa: causal attention to real tokens; a query that has none (left
    padding) attends to itself."""
    seqlen = attention_mask.shape[-1]
    allowed = torch.ones(seqlen, seqlen, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = allowed & attention_mask.bool()[:, None, :]
    empty = ~allowed.any(dim=-1, keepdim=True)
    allowed |= empty & torch.eye(seqlen, dtype=torch.bool, device=attention_mask.device)
    return allowed.unsqueeze(1)


VARLEN = "hybridrl_varlen"


def attention_implementation(device: str, packed: bool) -> str:
    """The attn_implementation to load a model with: a varlen kernel for packed forwards on CUDA, else sdpa."""
    if not packed or device != "cuda":
        return "sdpa"
    if find_spec("flash_attn") is not None:
        return "flash_attention_2"
    register()
    return VARLEN


@functools.cache
def register() -> None:
    """Register `hybridrl_varlen` (attention + mask function) with transformers, once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, _mask_unless_packed)


def _mask_unless_packed(*args, attention_mask=None, **kwargs):
    """sdpa's mask for padded calls; None for a packed call (no 2-D mask), which needs none."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: (1, heads, nnz, dim) packed q/k/v -> ((1, nnz, heads, dim), None).

    Sequence boundaries come from `cu_seq_lens_q` (passed by forward_packed) or, failing that, from
    the positions where position_ids return to 0.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    packed = query.shape[0] == 1 and attention_mask is None and query.shape[2] == key.shape[2]
    if not packed:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        cu_seqlens = cu_seqlens_from_positions(kwargs["position_ids"].reshape(-1))
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    else:
        max_seqlen = int(kwargs["max_length_q"])
    output = varlen_kernel()(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                             cu_seqlens.to(torch.int32), max_seqlen, scaling)
    return output.unsqueeze(0), None


def cu_seqlens_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """int32 sequence boundaries of a packed row: a sequence starts wherever its position is 0."""
    starts = (position_ids == 0).nonzero().squeeze(-1)
    end = torch.tensor([position_ids.numel()], device=position_ids.device)
    return torch.cat([starts, end]).to(torch.int32)


@functools.cache
def varlen_kernel():
    """causal varlen attention (nnz, heads, dim) -> (nnz, heads, dim) over PyTorch's flash kernel.

    The public signature changed across torch releases (is_causal= in 2.9/2.10, window_size=(-1, 0)
    later; enable_gqa only in later releases), so it is read once here instead of assumed.
    """
    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    native_gqa = "enable_gqa" in parameters

    def kernel(query, key, value, cu_seqlens, max_seqlen, scale):
        if query.shape[1] != key.shape[1]:
            if native_gqa:
                return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
                                   enable_gqa=True, **causal)
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale, **causal)

    return kernel
