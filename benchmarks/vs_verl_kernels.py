"""Which functions compute verl's log-probs and attention in benchmarks/vs_verl.py's verl run, shown by running them
(issue 59 item 1). Run with verl's PYTHONPATH (vs_verl.py --check-imports prints it; on the GPU host
/tmp/verl-tf-site:/tmp/verl-site:REPO:/tmp/site):

    PYTHONPATH=/tmp/verl-tf-site:/tmp/verl-site:$PWD:/tmp/site python3 benchmarks/vs_verl_kernels.py

A tiny Qwen2 model (the 0.5B shape's architecture) is loaded with `attn_implementation=hybridrl_varlen` after
importing benchmarks.vs_verl_attention (what verl's `model.external_lib` imports), and verl's own
`apply_monkey_patch(use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")` is applied, as
verl's FSDP engine does with the run's settings (engine/fsdp/transformer_impl.py:323-330). One packed forward of
three sequences, called as verl's engine calls it (attention_mask None, position_ids restarting per sequence,
shift_labels, temperature, return_dict), must then: attend through hybridrl_varlen once per layer, compute the
log-probs in FusedLinearForPPOFunction once, never call `logprobs_from_logits` or its row loop
`logprobs_from_logits_v2`, and give the log-probs of the same weights run per sequence with sdpa (float32, 1e-4).

On CUDA the varlen kernel is PyTorch's own; on a machine without CUDA a per-sequence causal sdpa stands in for it
(the routing and the boundaries are what is checked there). Run on the CPU on 2026-12-06 with transformers 5.9.0:
2 varlen calls, 1 fused call, 0 and 0, largest difference 4.8e-07.
"""
from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# transformers' optional hub-kernel integration is used by neither trainer; a `kernels` package newer than transformers
# 5.9.0 knows breaks transformers' import (a CPU development environment had one; the GPU image has none)
sys.modules.setdefault("kernels", None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

CALLS = {"hybridrl_varlen": 0, "FusedLinearForPPOFunction": 0, "logprobs_from_logits": 0,
         "logprobs_from_logits_v2": 0}


def counted(name: str, function):
    def wrapper(*args, **kwargs):
        CALLS[name] += 1
        return function(*args, **kwargs)
    return wrapper


def sdpa_varlen(query, key, value, cu_seqlens, max_seqlen, scale):
    """Without CUDA: causal attention inside each packed sequence, the varlen kernel's result, by sdpa."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = torch.empty_like(query)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
    return out


def count_calls(device: str) -> None:
    import hybridrl.models.attention as attention
    import verl.utils.torch_functional as verl_functional
    from verl.utils.experimental import torch_functional as verl_experimental

    kernel = attention.varlen_kernel() if device == "cuda" else sdpa_varlen
    attention.varlen_kernel = lambda: counted("hybridrl_varlen", kernel)
    for name in ("logprobs_from_logits", "logprobs_from_logits_v2"):
        setattr(verl_functional, name, counted(name, getattr(verl_functional, name)))
    fused = verl_experimental.FusedLinearForPPOFunction
    fused.apply = counted("FusedLinearForPPOFunction", fused.apply)


def main() -> None:
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import benchmarks.vs_verl_attention  # noqa: F401  what verl's model.external_lib imports
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the flash kernel takes half precision only
    count_calls(device)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    reference = Qwen2ForCausalLM._from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=dtype)
    model = Qwen2ForCausalLM._from_config(copy.deepcopy(config), attn_implementation="hybridrl_varlen", dtype=dtype)
    model.load_state_dict(reference.state_dict())
    reference, model = reference.to(device).eval(), model.to(device).eval()
    lengths = [7, 12, 5]
    sequences = [torch.randint(0, config.vocab_size, (n,), device=device) for n in lengths]
    packed = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    labels = torch.roll(packed, -1, dims=-1)  # verl's input_ids_rmpad_rolled, passed as shift_labels
    with torch.no_grad():
        expected = torch.cat([  # first: verl's patch replaces the model class's forward, the reference's too
            reference(input_ids=seq[None]).logits[0].float().log_softmax(-1).gather(-1, label[:, None])[:, 0]
            for seq, label in zip(sequences, torch.split(labels[0], lengths))])
        apply_monkey_patch(model=model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")
        out = model(input_ids=packed, attention_mask=None, position_ids=positions, temperature=1.0, return_dict=True,
                    shift_labels=labels)
    difference = float((out.log_probs[0].detach().float() - expected).abs().max())
    print(f"transformers {transformers.__version__}, {device}: calls {CALLS}, largest log-prob difference from "
          f"per-sequence sdpa {difference:.2e}")
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    problems = [f"{name}: {CALLS[name]} calls, expected {want}" for name, want in (
        ("hybridrl_varlen", config.num_hidden_layers), ("FusedLinearForPPOFunction", 1),
        ("logprobs_from_logits", 0), ("logprobs_from_logits_v2", 0)) if CALLS[name] != want]
    if difference > tolerance:
        problems.append(f"log-probs differ from per-sequence sdpa by {difference:.2e} (> {tolerance})")
    if problems:
        raise SystemExit("verl's kernels are not the ones vs_verl.py says: " + "; ".join(problems))
    print("verl's run attends through hybridrl_varlen and computes its log-probs in FusedLinearForPPOFunction")


if __name__ == "__main__":
    main()
