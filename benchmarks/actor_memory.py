"""Actor GPU memory on one GPU: the peak of a PPO update and what stays allocated between phases, with
gradient checkpointing, param_offload and optimizer_offload (issue 8).

    PYTHONPATH=. python benchmarks/actor_memory.py --model-dir /tmp/m/q05 --make-model --out $OUT/memory.json
    PYTHONPATH=. python benchmarks/actor_memory.py --device cpu --tiny     # smoke check of the wiring only

One process, world size 1 (NCCL on the GPU, gloo on the CPU). The actor is the real ActorRolloutRefWorker
(role=actor), as a training run builds it: FSDP2 over a Qwen2.5-0.5B-architecture model with random
weights (see hybrid_engine.py), fp32 master weights, bf16 compute, AdamW. Each configuration gets a
fresh worker, which runs compute_log_prob, one PPO update (it creates AdamW's state), then the measured
compute_log_prob and update: one mini-batch of 8 sequences x (512 prompt + 512 response) tokens, in
micro-batches of 4. Columns (GiB, allocated by torch's CUDA allocator above what was allocated before
the worker existed):
  peak log-prob   max allocated during the measured compute_log_prob
  peak update     max allocated during the measured update_actor (loading/parking the offloaded state included)
  held            allocated after the update: what the phases in between (rollout, other models) cannot use
  state on GPU    parameters + gradients + optimizer state found on the GPU after the update, tensor by
                  tensor (a cross-check of `held`)
  update s        wall time of the measured update, transfers included
  pg_loss         of the measured update: equal across configurations up to bf16 noise (same computation)
On the CPU (`--device cpu`) there are no allocator numbers: the smoke run checks that every configuration
builds, trains and reports.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import tempfile
import time

import torch

from benchmarks.hybrid_engine import QWEN25_05B, make_qwen05b_model
import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
from hybridrl.config import compose_config, validate_config
from hybridrl.protocol import DataProto
from hybridrl.models.spec import policy_model_spec
from hybridrl.workers.actor_rollout_ref import ActorRolloutRefWorker

GiB, MiB = 1 << 30, 1 << 20
CHECKPOINTING = "actor_rollout_ref.model.enable_gradient_checkpointing=true"
PARAM_OFFLOAD = "actor_rollout_ref.actor.fsdp_config.param_offload=true"
OPTIMIZER_OFFLOAD = "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"
CONFIGS = {
    "baseline": [],
    "gradient checkpointing": [CHECKPOINTING],
    "param_offload": [PARAM_OFFLOAD],
    "optimizer_offload": [OPTIMIZER_OFFLOAD],
    "param + optimizer offload": [PARAM_OFFLOAD, OPTIMIZER_OFFLOAD],
    "all three": [CHECKPOINTING, PARAM_OFFLOAD, OPTIMIZER_OFFLOAD],
}
# --tiny: the 0.5B architecture shrunk to seconds on a CPU (same model class, tied embeddings, GQA).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024)


def make_tiny_model(model_dir: str) -> str:
    """A random-weight Qwen2 of the TINY shape saved to `model_dir`, built on the CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**{**QWEN25_05B, **TINY}, use_sliding_window=False)).save_pretrained(model_dir)
    return model_dir


def set_rendezvous_env() -> None:
    """World size 1: the worker joins the process group itself (nccl on the GPU, gloo on the CPU)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, value)


def actor_config(model_dir: str, device: str, args, overrides: list[str]):
    """The validated config of one actor on one device training `args.rows` sequences per update."""
    return validate_config(compose_config([
        f"actor_rollout_ref.model.path={model_dir}", "data.train_files=unused.parquet", "data.val_files=unused.parquet",
        f"data.max_prompt_length={args.prompt_length}", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.rows}", "actor_rollout_ref.rollout.n=1",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.rows}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        "trainer.n_gpus_per_node=1", f"trainer.device={device}", *overrides]))


def ppo_batch(rows: int, prompt_length: int, response_length: int, vocab_size: int) -> DataProto:
    """Random full-length sequences (no padding) with one random advantage per sequence."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (rows, prompt_length + response_length), generator=generator)
    response_mask = torch.ones(rows, response_length, dtype=torch.long)
    return DataProto.from_dict({
        "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
        "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids).clone(),
        "responses": input_ids[:, prompt_length:], "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=generator) * response_mask})


class Allocator:
    """torch.cuda's allocated-bytes counters on the GPU; on the CPU every reading is None."""

    def __init__(self, device: str):
        self.gpu = device == "cuda"

    def synchronize(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def allocated(self) -> int | None:
        return torch.cuda.memory_allocated() if self.gpu else None

    def reset_peak(self) -> None:
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() if self.gpu else None


def state_bytes_on(worker: ActorRolloutRefWorker, device_type: str) -> int:
    """Bytes of the actor's parameter shards, gradients and optimizer state that are on `device_type`."""
    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    tensors = [local(p) for p in worker.actor_module.parameters()]
    tensors += [local(p.grad) for p in worker.actor_module.parameters() if p.grad is not None]
    tensors += [local(value) for state in worker.actor_optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == device_type)


def measure(config, batch: DataProto, device: str) -> dict:
    """Build one actor, warm it up with one update, then measure a compute_log_prob and an update (see the
    module docstring); the worker is gone again when this returns."""
    allocator = Allocator(device)
    allocator.synchronize()
    before = allocator.allocated()
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, policy_model_spec(config),
                                   role="actor", seed=0, device=device)
    worker.init_model()
    data = DataProto.from_dict(dict(batch.batch))
    data.batch["old_log_probs"] = worker.compute_log_prob(data).batch["old_log_probs"]
    worker.update_actor(data)  # the first update creates AdamW's state

    allocator.reset_peak()
    worker.compute_log_prob(data)
    allocator.synchronize()
    peak_log_prob = allocator.peak()
    allocator.reset_peak()
    started = time.perf_counter()
    metrics = worker.update_actor(data).meta_info["metrics"]
    allocator.synchronize()
    result = {"update_s": time.perf_counter() - started, "pg_loss": metrics["actor/pg_loss"][0],
              "state_on_device": state_bytes_on(worker, device)}
    if allocator.gpu:
        result.update(peak_log_prob=peak_log_prob - before, peak_update=allocator.peak() - before,
                      held=allocator.allocated() - before)
    del worker
    gc.collect()
    if allocator.gpu:
        torch.cuda.empty_cache()
        leftover = torch.cuda.memory_allocated() - before
        if leftover > 16 * MiB:
            print(f"warning: {leftover / MiB:.0f} MiB still allocated after the worker was deleted; "
                  f"the next configuration's numbers include it")
    return result


def print_table(results: dict[str, dict], unit: int, unit_name: str) -> None:
    baseline = results["baseline"]
    header = ["configuration", f"peak log-prob ({unit_name})", f"peak update ({unit_name})", f"held ({unit_name})",
              f"state on device ({unit_name})", "update s", "pg_loss", "peak update / baseline", "held / baseline"]
    rows = []
    for name, result in results.items():
        def amount(key: str) -> str:
            return "-" if key not in result else f"{result[key] / unit:.3f}"

        def ratio(key: str) -> str:
            return "-" if key not in result or not baseline.get(key) else f"{result[key] / baseline[key]:.3f}"

        rows.append([name, amount("peak_log_prob"), amount("peak_update"), amount("held"),
                     amount("state_on_device"), f"{result['update_s']:.2f}", f"{result['pg_loss']:.6f}",
                     ratio("peak_update"), ratio("held")])
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", help="the model (default with --tiny: a temporary directory)")
    parser.add_argument("--make-model", action="store_true", help="create the random 0.5B model if the dir is empty")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same architecture (smoke check)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", help="write all numbers here as JSON")
    args = parser.parse_args()
    if "baseline" not in args.configs:
        parser.error("--configs must include baseline (the ratios are against it)")

    if args.tiny:
        model_dir = make_tiny_model(args.model_dir or tempfile.mkdtemp(prefix="actor_memory_"))
    elif args.model_dir is None:
        parser.error("--model-dir is required without --tiny")
    else:
        model_dir = make_qwen05b_model(args.model_dir) if args.make_model else args.model_dir
    set_rendezvous_env()
    vocab_size = (TINY if args.tiny else QWEN25_05B)["vocab_size"]
    batch = ppo_batch(args.rows, args.prompt_length, args.response_length, vocab_size)
    results = {}
    for name in args.configs:
        results[name] = measure(actor_config(model_dir, args.device, args, CONFIGS[name]), batch, args.device)
        print(f"{name}: {results[name]}", flush=True)

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\n{device_name}, {'tiny' if args.tiny else 'Qwen2.5-0.5B'}-shaped actor, {args.rows} x "
          f"({args.prompt_length} + {args.response_length}) tokens, micro-batch {args.micro_batch}")
    unit, unit_name = (MiB, "MiB") if args.tiny else (GiB, "GiB")
    print_table(results, unit, unit_name)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"device": device_name, "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                       "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
