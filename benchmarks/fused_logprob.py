"""Fused linear log-probs (model.use_fused_kernels) against the plain logits path: peak memory and time.

    PYTHONPATH=. python benchmarks/fused_logprob.py                  # on a GPU: 8192 tokens, Qwen2.5's vocab, bf16
    PYTHONPATH=. python benchmarks/fused_logprob.py --device cpu --tokens 2048 --vocab 32000 --hidden 256 \
        --chunk-tokens 256 --repeats 1

One output layer, no model around it: `tokens` hidden states (tokens x hidden) and a (vocab x hidden)
weight in the compute dtype (bf16 on CUDA, fp32 on CPU), temperature 0.7.
  plain  the actor's path without fusion: logits = hidden @ weight.T / temperature, then
         logprobs_from_logits and entropy_from_logits (float32 one row chunk at a time)
  fused  models/fused_logprob.linear_log_probs, chunks of --chunk-tokens rows (default: the library's
         CHUNK_LOGITS // vocab, 441 tokens at vocab 151936; a small CPU run needs a smaller chunk to chunk at all)
Each is run as compute_log_prob runs it (no grad: log-probs + entropy) and as a training step runs it
(log-probs + entropy into a loss, backward into hidden and weight). Columns:
  peak MiB  CUDA: torch.cuda.max_memory_allocated above what was allocated before (inputs excluded).
            CPU: no allocator statistics, so the largest single tensor any op allocates (a dispatch mode).
  seconds   median of --repeats runs after one warm-up (CPU times taken without the dispatch mode).
  x plain   fused / plain, from the same run.
The last line says how far fused is from plain: log-probs, entropy, gradients (fp32: ~1e-6; bf16: the plain
path divides bf16 logits by the temperature in bf16, the fused one in float32, so close, not equal).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybridrl.models.fused_logprob import CHUNK_LOGITS, linear_log_probs
from hybridrl.algorithms.torch_functional import entropy_from_logits, logprobs_from_logits

TEMPERATURE = 0.7


def plain_log_probs(hidden, weight, labels, temperature):
    """The unfused path, as DataParallelPPOActor runs it: full logits in the compute dtype, then the helpers."""
    logits = hidden @ weight.T / temperature
    return logprobs_from_logits(logits, labels), entropy_from_logits(logits)


def fused_log_probs(hidden, weight, labels, temperature, chunk_tokens=None):
    return linear_log_probs(hidden, weight, labels, temperature, calculate_entropy=True, chunk_tokens=chunk_tokens)


def make_inputs(tokens: int, vocab: int, hidden_size: int, dtype: torch.dtype, device: str, seed: int = 0):
    """hidden (tokens x H), weight (vocab x H) at an LM head's scale, labels, and the loss's per-token weights."""
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator, device=device) / hidden_size ** 0.5).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=device)
    upstream = torch.randn(2, tokens, generator=generator, device=device)
    return hidden, weight, labels, upstream


def run_step(path, hidden, weight, labels, upstream, backward: bool) -> tuple[torch.Tensor, ...]:
    """One compute_log_prob-style pass (backward=False, no grad): (log-probs, entropy); or one training-style
    forward + backward: (log-probs, entropy, gradient of hidden, gradient of weight)."""
    if not backward:
        with torch.no_grad():
            return path(hidden, weight, labels, TEMPERATURE)
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    log_probs, entropy = path(hidden, weight, labels, TEMPERATURE)
    ((upstream[0] * log_probs).sum() + (upstream[1] * entropy).sum()).backward()
    return log_probs.detach(), entropy.detach(), hidden.grad, weight.grad


class LargestAllocation(TorchDispatchMode):
    """The largest tensor any op allocates (views excluded): the CPU's stand-in for a peak-memory counter."""

    def __init__(self):
        super().__init__()
        self.max_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        output = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor):
                    self.max_bytes = max(self.max_bytes, tensor.numel() * tensor.element_size())
        return output


def peak_bytes(step, device: str) -> int:
    """Peak memory of one call of `step` (see the module docstring for what it means on each device)."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with LargestAllocation() as watch:
        step()
    return watch.max_bytes


def median_seconds(step, device: str, repeats: int) -> float:
    step()  # warm-up
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(tokens: int, vocab: int, hidden_size: int, device: str, repeats: int, chunk_tokens: int | None = None
            ) -> dict:
    """{(phase, path): (peak bytes, seconds)} plus how far the fused results are from the plain ones."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    inputs = make_inputs(tokens, vocab, hidden_size, dtype, device)
    paths = {"plain": plain_log_probs,
             "fused": lambda *args: fused_log_probs(*args, chunk_tokens=chunk_tokens)}
    results = {}
    for phase, backward in (("log-probs", False), ("log-probs + backward", True)):
        for name, path in paths.items():
            def step(path=path, backward=backward):
                return run_step(path, *inputs, backward=backward)
            results[phase, name] = (peak_bytes(step, device), median_seconds(step, device, repeats))
    plain, fused = (run_step(paths[name], *inputs, backward=True) for name in ("plain", "fused"))
    results["differences"] = differences(plain, fused)
    return results


def differences(plain: tuple[torch.Tensor, ...], fused: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """Largest log-prob and entropy difference; relative L2 difference of the two gradients."""
    def relative(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    return {"max |log-prob diff|": (fused[0] - plain[0]).abs().max().item(),
            "max |entropy diff|": (fused[1] - plain[1]).abs().max().item(),
            "grad hidden rel. L2 diff": relative(fused[2], plain[2]),
            "grad weight rel. L2 diff": relative(fused[3], plain[3])}


def print_table(results: dict, args, device: str) -> None:
    memory = "peak MiB" if device == "cuda" else "largest tensor MiB"
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    chunk = args.chunk_tokens or f"{CHUNK_LOGITS // args.vocab} (default)"
    print(f"\n{card}: tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, "
          f"{'bf16' if device == 'cuda' else 'fp32'}, temperature {TEMPERATURE}, fused chunk {chunk} tokens, "
          f"median of {args.repeats}")
    print(f"| phase | path | {memory} | x plain | seconds | x plain |")
    print("| --- | --- | --- | --- | --- | --- |")
    for phase in ("log-probs", "log-probs + backward"):
        plain_bytes, plain_seconds = results[phase, "plain"]
        for name in ("plain", "fused"):
            peak, seconds = results[phase, name]
            print(f"| {phase} | {name} | {peak / 2**20:,.1f} | {peak / plain_bytes:.3f} | {seconds:.4f} | "
                  f"{seconds / plain_seconds:.2f} |")
    print(", ".join(f"{name} {value:.3g}" for name, value in results["differences"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results = measure(args.tokens, args.vocab, args.hidden, args.device, args.repeats, args.chunk_tokens)
    print_table(results, args, args.device)


if __name__ == "__main__":
    main()
