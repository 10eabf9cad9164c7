"""Fused linear log-probs: response log-probs and entropy without ever holding full-vocabulary logits.

`actor_rollout_ref.model.use_fused_kernels`. The plain actor path asks the model for its logits,
(tokens x vocab) in the compute dtype, and keeps float32 copies of them for the backward pass; at a
150k vocabulary and 8k response tokens that is several GiB per micro-batch, more than the rest of a
0.5B model's activations. Here the output layer is folded into the log-prob computation:

    hidden (tokens x H) --chunk of rows--> logits (chunk x vocab) --float32--> log p(label), entropy

`linear_log_probs` walks the tokens in chunks of at most `CHUNK_LOGITS` logits; its autograd
Function saves only the hidden states, the weight and the labels, and its backward recomputes each
chunk's logits to build the gradients of the hidden states and of the weight. Forward and backward
thus hold one chunk of logits at a time. The numbers are the plain path's: log p(y) = z_y - lse(z)
and H = lse(z) - sum(softmax(z) * z) with z = logits / temperature, evaluated in float32.

`response_log_probs_fused` runs a HF causal LM (plain, peft-wrapped, FSDP1- or FSDP2-sharded) so
that its output layer never multiplies out the logits: for the one forward call, the output
layer's `forward` is replaced by the fused computation on the response-scoring hidden states. The
model is still entered through its own (root) forward, so FSDP gathers the output weight and
reduces its gradient exactly as in the plain path. Models that change the output layer's result
afterwards (logit soft-capping, logit scaling) are refused, since the fused numbers would skip that.

liger-kernel (GPU only) has Triton kernels close to this: `LigerFusedLinearCrossEntropyFunction`
(per-token cross-entropy with reduction="none", but no temperature and no entropy output) and
`LigerFusedLinearGRPOLoss` (lm_head fused with one fixed GRPO loss, returning the loss, not the
per-token log-probs and entropy that the registered policy losses consume). Neither gives what the
actor needs, so this is plain torch code that runs on CPU and GPU alike.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridrl.models.attention import padded_attention_mask
from hybridrl.models.fsdp_utils import hf_module
from hybridrl.models.padding import response_scoring_rows, unpad_input

__all__ = ["CHUNK_LOGITS", "linear_log_probs", "response_log_probs_fused"]

# Logits per chunk (2**26 = 256 MiB in float32): 441 tokens of a 151936-token vocabulary.
CHUNK_LOGITS = 2**26


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
                     calculate_entropy: bool = False, chunk_tokens: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) and the entropy of softmax(hidden @ weight.T / temperature), one float32 value per row.

    hidden: (tokens, H) in the compute dtype; weight: (vocab, H), the output layer's; labels: (tokens,).
    chunk_tokens: rows per chunk (default: CHUNK_LOGITS // vocab). Differentiable w.r.t. hidden and
    weight; the entropy is None unless calculate_entropy.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_log_probs: hidden {tuple(hidden.shape)} must be (tokens, H) and weight "
                         f"{tuple(weight.shape)} (vocab, H) with the same H")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"linear_log_probs: labels {tuple(labels.shape)} must hold one token id per hidden row "
                         f"({hidden.shape[0]})")
    chunk_tokens = chunk_tokens or max(1, CHUNK_LOGITS // weight.shape[0])
    return _LinearLogProbs.apply(hidden, weight, labels, temperature, chunk_tokens, calculate_entropy)


class _LinearLogProbs(torch.autograd.Function):
    """The chunked computation; backward recomputes each chunk's logits instead of saving them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_tokens, calculate_entropy):
        log_probs = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(log_probs) if calculate_entropy else None
        for rows in _chunks(len(hidden), chunk_tokens):
            scaled = _scaled_logits(hidden[rows], weight, temperature)
            log_normaliser = scaled.logsumexp(dim=-1)
            log_probs[rows] = scaled.gather(-1, labels[rows].unsqueeze(-1)).squeeze(-1) - log_normaliser
            if entropy is not None:
                entropy[rows] = log_normaliser - (torch.softmax(scaled, dim=-1) * scaled).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # an unused output (a detached entropy) gets None, not zeros
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # float32 accumulation over chunks; a frozen weight (LoRA) gets no buffer at all
        grad_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                       if ctx.needs_input_grad[1] else None)
        for rows in _chunks(len(hidden), ctx.chunk_tokens):
            scaled = _scaled_logits(hidden[rows], weight, ctx.temperature)
            grad_scaled = _grad_of_scaled_logits(scaled, labels[rows], _rows_of(grad_log_probs, rows),
                                                 _rows_of(grad_entropy, rows))
            grad_logits = grad_scaled.div_(ctx.temperature).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.add_(grad_logits.T @ hidden[rows])  # upcast element by element, no float32 copy
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


def _chunks(num_rows: int, chunk_tokens: int) -> list[slice]:
    return [slice(start, start + chunk_tokens) for start in range(0, num_rows, chunk_tokens)]


def _rows_of(grad: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if grad is None else grad[rows]


def _scaled_logits(hidden_rows: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """z = logits / temperature in float32; the matmul runs in the compute dtype, as the plain output layer's."""
    return F.linear(hidden_rows, weight).float().div_(temperature)


def _grad_of_scaled_logits(scaled: torch.Tensor, labels: torch.Tensor, grad_log_probs: torch.Tensor | None,
                           grad_entropy: torch.Tensor | None) -> torch.Tensor:
    """The loss's gradient w.r.t. z for one chunk, given its gradients w.r.t. log p(label) and H.

    d log p_y / dz = onehot(y) - p;  dH / dz = -p * (z - sum_k p_k z_k). Overwrites `scaled` (and
    reuses its memory for the result), so a chunk holds three (rows x vocab) float32 tensors at most.
    """
    probs = torch.softmax(scaled, dim=-1)
    if grad_entropy is not None:
        expected = (probs * scaled).sum(dim=-1, keepdim=True)
        grad = scaled.sub_(expected).mul_(probs).mul_(-grad_entropy.unsqueeze(-1))
    else:
        grad = torch.zeros_like(probs)
    if grad_log_probs is not None:
        grad.sub_(probs.mul_(grad_log_probs.unsqueeze(-1)))
        grad.scatter_add_(-1, labels.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
    return grad


# ---------------------------------------------------------------------- a HF causal LM, fused

def response_log_probs_fused(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             position_ids: torch.Tensor, responses: torch.Tensor, temperature: float,
                             calculate_entropy: bool = False, entropy_grad: bool = False,
                             remove_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) under logits / temperature, (rows, R) float32, as the actor's plain paths give it.

    remove_padding=False: one padded forward; like the plain padded path, every response position gets
    a number (padding ones are arbitrary and masked later). remove_padding=True: one packed forward
    (models/padding.py), 0 at response padding. The entropy carries a gradient only with entropy_grad.
    """
    rows, response_length = responses.shape
    if remove_padding:
        scoring_rows, response_attended = response_scoring_rows(attention_mask, response_length)
        packed = unpad_input(input_ids, attention_mask, position_ids)
        inputs = packed.model_inputs()
        per_token = _forward_fused(model, inputs, lambda hidden: hidden[0, scoring_rows],
                                   responses[response_attended], temperature, calculate_entropy, entropy_grad)
        per_position = per_token.new_zeros(rows, response_length, per_token.shape[-1])
        per_position[response_attended] = per_token
    else:
        seqlen = input_ids.shape[1]

        def response_scoring(hidden: torch.Tensor) -> torch.Tensor:  # output t scores token t + 1
            return hidden[:, seqlen - response_length - 1:seqlen - 1].reshape(-1, hidden.shape[-1])

        inputs = {"input_ids": input_ids, "attention_mask": padded_attention_mask(attention_mask),
                  "position_ids": position_ids, "use_cache": False}
        per_token = _forward_fused(model, inputs, response_scoring, responses.reshape(-1), temperature,
                                   calculate_entropy, entropy_grad)
        per_position = per_token.reshape(rows, response_length, per_token.shape[-1])
    return per_position[..., 0], (per_position[..., 1] if calculate_entropy else None)


def _forward_fused(model: nn.Module, inputs: dict, select: Callable[[torch.Tensor], torch.Tensor],
                   labels: torch.Tensor, temperature: float, calculate_entropy: bool, entropy_grad: bool
                   ) -> torch.Tensor:
    """One forward whose output layer returns (tokens, 1 or 2): log p(label) [, entropy] of the `select`ed rows.

    The output layer's `forward` is shadowed by an instance attribute for this call only, so the
    model's own forward (and FSDP's hooks around it) runs unchanged up to the last hidden states.
    """
    head = output_layer(model)
    fused = {}

    def fused_head(hidden_states: torch.Tensor) -> torch.Tensor:
        log_probs, entropy = linear_log_probs(select(hidden_states), head.weight, labels, temperature,
                                              calculate_entropy)
        columns = [log_probs] if entropy is None else [log_probs, entropy if entropy_grad else entropy.detach()]
        fused["per_token"] = torch.stack(columns, dim=-1)
        return fused["per_token"]

    head.forward = fused_head
    try:
        output = model(**inputs)
    finally:
        del head.forward
    if output.logits is not fused.get("per_token"):
        raise ValueError(f"actor_rollout_ref.model.use_fused_kernels: {type(hf_module(model)).__name__}'s forward "
                         f"transforms its output layer's result (e.g. logit soft-capping or scaling), which the fused "
                         f"log-prob would skip; set use_fused_kernels=false for this model")
    return output.logits


def output_layer(model: nn.Module) -> nn.Linear:
    """The model's output layer (lm_head) behind FSDP1 and peft wrappers; it must be a bias-free nn.Linear."""
    head = hf_module(model).get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        raise ValueError(f"actor_rollout_ref.model.use_fused_kernels: expected the output layer of "
                         f"{type(hf_module(model)).__name__} to be a bias-free torch.nn.Linear (the fused log-prob "
                         f"uses its weight alone), got {type(head).__module__}.{type(head).__qualname__}"
                         f"{' with a bias' if getattr(head, 'bias', None) is not None else ''}; a LoRA adapter on "
                         f"lm_head is not supported")
    if "forward" in vars(head):  # e.g. an accelerate hook: shadowing it would skip what it does
        raise ValueError(f"actor_rollout_ref.model.use_fused_kernels: the output layer of "
                         f"{type(hf_module(model)).__name__} already has its forward replaced "
                         f"({vars(head)['forward']!r}), which the fused log-prob would skip")
    return head
