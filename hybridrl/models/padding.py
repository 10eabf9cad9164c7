"""Remove padding: run a batch as one packed row of real tokens, then put results back in place.

A padded batch (rows x seqlen) spends attention and MLP FLOPs on padding; a rollout batch with
left-padded prompts and right-padded responses is often half padding. Packing concatenates the
attended tokens of all rows into a single row of `nnz` tokens, with position_ids restarting at 0
for every sequence, and runs the model once with attention_mask=None:

- transformers (5.x) reads such position_ids as packed sequences. For the `sdpa` and `eager`
  attention implementations `masking_utils.find_packed_sequence_indices` splits the row where the
  position does not step by +1, and `create_causal_mask` builds a block-diagonal causal mask, so no
  token attends across a sequence boundary (checked against the padded forward in
  tests/test_padding.py, fp32, 1e-5). That mask is a dense nnz x nnz boolean: fine for CPU tests
  and short batches, never for GPU-sized micro-batches.
- On CUDA the model is loaded with a varlen attention (models/varlen_attention.py: flash-attn's
  `flash_attention_2` where installed, else PyTorch's own flash varlen kernel): it reads the
  sequence boundaries (`cu_seqlens`, passed with the packed row) and no mask is ever built.
- The forward must get `use_cache=False`: with a KV cache, transformers skips the packed-sequence
  detection and the sequences would attend to each other. Every helper here passes it.

The model must rotate positions from position_ids (every RoPE decoder does); each sequence's
position_ids must run 0, 1, ..., len-1, which is what the trainer builds from the attention mask.

Response positions: in the actor's layout (left-padded prompt, right-padded response, width
seqlen, response width R) the logit at padded position t predicts token t+1, so response token j
is scored by the output at position seqlen - R - 1 + j. `response_log_probs_packed` and
`response_values_packed` read exactly those packed outputs and return (rows, R) tensors that are 0
where the response is padding (the padded path leaves arbitrary numbers there; both are masked).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from hybridrl.algorithms.torch_functional import entropy_from_logits, logprobs_from_logits

__all__ = ["PackedInputs", "unpad_input", "pad_output", "forward_packed", "response_log_probs_packed",
           "response_values_packed"]


class PackedInputs(NamedTuple):
    """A batch packed into one row. Unpacks as the tuple (input_ids, position_ids, indices, cu_seqlens, max_seqlen)."""

    input_ids: torch.Tensor     # (1, nnz) the attended tokens of every row, row after row
    position_ids: torch.Tensor  # (1, nnz) 0..len-1 within each sequence
    indices: torch.Tensor       # (nnz,) where each packed token sat in the flattened (rows * seqlen) batch
    cu_seqlens: torch.Tensor    # (rows + 1,) int32 sequence boundaries, flash-attn's varlen convention
    max_seqlen: int             # the longest sequence's token count

    def model_inputs(self) -> dict:
        """The forward's keyword arguments: the packed row with no mask, plus the sequence boundaries that
        varlen attention kernels read (transformers' FlashAttentionKwargs; sdpa ignores them)."""
        return {"input_ids": self.input_ids, "attention_mask": None, "position_ids": self.position_ids,
                "cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen, "use_cache": False}


def unpad_input(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> PackedInputs:
    """Pack the tokens where attention_mask is set into one row; position_ids must restart at 0 per sequence.

    A sequence whose position_ids do not run 0, 1, 2, ... is an error: the model would merge it with
    its neighbour (sdpa/eager split where positions stop stepping by one, flash attention where
    they return to 0), so the packed forward would silently differ from the padded one.
    """
    if input_ids.shape != attention_mask.shape or input_ids.shape != position_ids.shape or input_ids.dim() != 2:
        raise ValueError(f"unpad_input: input_ids {tuple(input_ids.shape)}, attention_mask "
                         f"{tuple(attention_mask.shape)} and position_ids {tuple(position_ids.shape)} must all be "
                         f"(rows, seqlen); 3-d (mrope) position_ids are not supported")
    attended = attention_mask.bool()
    indices = attended.reshape(-1).nonzero().squeeze(-1)
    seqlens = attended.sum(dim=-1)
    if indices.numel() == 0:
        raise ValueError("unpad_input: the attention mask selects no token in any row")
    cu_seqlens = torch.zeros(len(seqlens) + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = seqlens.cumsum(dim=0)
    packed_positions = position_ids.reshape(-1)[indices]
    expected = _positions_within_sequences(seqlens, cu_seqlens)
    if not torch.equal(packed_positions, expected.to(packed_positions.dtype)):
        row = _first_row_with_bad_positions(packed_positions, expected, cu_seqlens)
        raise ValueError(f"unpad_input: row {row}'s position_ids at its attended tokens are "
                         f"{packed_positions[cu_seqlens[row]:cu_seqlens[row + 1]].tolist()}, expected 0..len-1; build "
                         f"position_ids as (attention_mask.cumsum(-1) - 1).clamp(min=0)")
    return PackedInputs(input_ids.reshape(-1)[indices].unsqueeze(0), packed_positions.unsqueeze(0), indices,
                        cu_seqlens, int(seqlens.max()))


def _positions_within_sequences(seqlens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """0..len-1 for each sequence, concatenated: a packed token's index minus its sequence's start."""
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), seqlens)
    return torch.arange(int(cu_seqlens[-1]), device=seqlens.device) - starts


def _first_row_with_bad_positions(actual: torch.Tensor, expected: torch.Tensor, cu_seqlens: torch.Tensor) -> int:
    first_bad_token = int((actual != expected.to(actual.dtype)).nonzero()[0])
    return int(torch.searchsorted(cu_seqlens.long(), torch.tensor(first_bad_token, device=cu_seqlens.device),
                                  right=True)) - 1


def pad_output(packed: torch.Tensor, indices: torch.Tensor, batch_size: int, seqlen: int) -> torch.Tensor:
    """Put packed per-token outputs (nnz, ...) back at their padded places: (batch_size, seqlen, ...), 0 elsewhere."""
    if packed.shape[0] != indices.numel():
        raise ValueError(f"pad_output: {packed.shape[0]} packed rows for {indices.numel()} indices")
    padded = packed.new_zeros(batch_size * seqlen, *packed.shape[1:])
    padded[indices] = packed  # index_put keeps autograd: gradients flow back to the packed rows
    return padded.reshape(batch_size, seqlen, *packed.shape[1:])


def forward_packed(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   position_ids: torch.Tensor) -> tuple[torch.Tensor, PackedInputs]:
    """One packed forward: the model's per-token output (`logits`) as (nnz, ...), and the packing."""
    packed = unpad_input(input_ids, attention_mask, position_ids)
    output = model(**packed.model_inputs())
    return output.logits.squeeze(0), packed


def response_scoring_rows(attention_mask: torch.Tensor, response_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed rows whose output scores each attended response token, that tokens' (rows, R) mask).

    Response token j of a row sits at padded position seqlen - R + j and is scored by position
    seqlen - R - 1 + j, which must itself be attended (the prompt's last token or the previous
    response token). A packed token's row is the count of attended tokens before it.
    """
    rows, seqlen = attention_mask.shape
    if not 0 < response_length < seqlen:
        raise ValueError(f"response length {response_length} must be between 1 and seqlen - 1 = {seqlen - 1} "
                         f"(at least one prompt token precedes the response)")
    attended = attention_mask.bool()
    response_attended = attended[:, seqlen - response_length:]
    scoring = attended[:, seqlen - response_length - 1:seqlen - 1]
    orphan = response_attended & ~scoring
    if orphan.any():
        row, column = (int(value) for value in orphan.nonzero()[0])
        raise ValueError(f"row {row}: response token {column} follows a padding position; expected a left-padded "
                         f"prompt followed by a right-padded response")
    packed_row_of = attended.reshape(-1).long().cumsum(dim=0).reshape(rows, seqlen) - 1
    return packed_row_of[:, seqlen - response_length - 1:seqlen - 1][response_attended], response_attended


def response_log_probs_packed(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              position_ids: torch.Tensor, responses: torch.Tensor, temperature: float,
                              calculate_entropy: bool = False, entropy_grad: bool = False,
                              entropy_fn: Callable[[torch.Tensor], torch.Tensor] = entropy_from_logits
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) under logits / temperature, (rows, R) float32, from one packed forward.

    The vocabulary work (log-softmax, entropy) runs only on the rows that score response tokens.
    With calculate_entropy also the per-token entropy, by `entropy_fn` (torch_functional.entropy_function); it
    carries a gradient only with entropy_grad (when it is part of the loss), otherwise it is computed from
    detached logits.
    """
    scoring_rows, response_attended = response_scoring_rows(attention_mask, responses.shape[1])
    logits, _ = forward_packed(model, input_ids, attention_mask, position_ids)
    response_logits = logits[scoring_rows] / temperature
    log_probs = torch.zeros(responses.shape, dtype=torch.float32, device=logits.device)
    log_probs[response_attended] = logprobs_from_logits(response_logits, responses.to(logits.device)[response_attended])
    if not calculate_entropy:
        return log_probs, None
    entropy = torch.zeros_like(log_probs)
    if entropy_grad:
        entropy[response_attended] = entropy_fn(response_logits)
    else:
        with torch.no_grad():
            entropy[response_attended] = entropy_fn(response_logits.detach())
    return log_probs, entropy


def response_values_packed(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                           position_ids: torch.Tensor, response_length: int) -> torch.Tensor:
    """Values V(state before each response token), (rows, R) float32, from one packed forward of a
    one-output token-classification model (the critic)."""
    scoring_rows, response_attended = response_scoring_rows(attention_mask, response_length)
    outputs, _ = forward_packed(model, input_ids, attention_mask, position_ids)
    values = torch.zeros(response_attended.shape, dtype=torch.float32, device=outputs.device)
    values[response_attended] = outputs[scoring_rows, 0].float()
    return values
