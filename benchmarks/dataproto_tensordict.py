"""DataProto's batch as our dict of tensors vs as a `tensordict.TensorDict` (verl's), on a realistic PPO batch.

The question (issue 57): should hybridrl.protocol adopt tensordict for `DataProto.batch`? This times the operations
the trainer runs on every step, the same work done both ways, median of --repeats runs each (the ways compared run
in turn within each repeat):

- concat (8 worker outputs into one), chunk (into 8 dispatches), split (into 16 mini-batches), select (5 keys),
  index (a shuffled permutation of the rows, as make_iterator), to("cpu") (a no-op move: the per-call overhead);
- the Ray round trip of the batch to an actor and back: ours (hybridrl.protocol's flat byte views, out of band)
  vs verl's default (TensorDict.consolidate + torch.save bytes) vs TensorDict's own pickling.

    python benchmarks/dataproto_tensordict.py --rows 1024 --prompt 2048 --response 2048 --repeats 5
"""
from __future__ import annotations

import argparse
import io
import statistics
import time

import ray
import torch
from tensordict import TensorDict

from hybridrl.protocol import DataProto


def ppo_batch(rows: int, prompt: int, response: int) -> dict[str, torch.Tensor]:
    """The tensors of one PPO step's batch: 3 sequence-long int64 keys, 1 response-long int64, 8 response-long float."""
    sequence = prompt + response
    generator = torch.Generator().manual_seed(0)
    tensors = {key: torch.randint(0, 32000, (rows, sequence), generator=generator)
               for key in ("input_ids", "attention_mask", "position_ids")}
    tensors["responses"] = torch.randint(0, 32000, (rows, response), generator=generator)
    for key in ("response_mask", "old_log_probs", "ref_log_prob", "values", "advantages", "returns",
                "token_level_scores", "token_level_rewards"):
        tensors[key] = torch.randn(rows, response, generator=generator)
    return tensors


def seconds(operation) -> float:
    start = time.perf_counter()
    result = operation()
    elapsed = time.perf_counter() - start
    del result  # freed before the next run: each run allocates its output afresh
    return elapsed


def paired_medians(operations: list, repeats: int) -> list[float]:
    """Median seconds of each operation, run in turn within every repeat (so that the allocator's and the machine's
    state at the time fall on all of them alike), after one warm-up round."""
    times = [[] for _ in operations]
    for round_index in range(repeats + 1):
        for index, operation in enumerate(operations):
            elapsed = seconds(operation)
            if round_index:
                times[index].append(elapsed)
    return [statistics.median(each) for each in times]


def local_operations(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Each operation as (ours, tensordict's), doing the same work on the same tensors."""
    rows = len(next(iter(tensors.values())))
    ours = DataProto(tensors)
    theirs = TensorDict(tensors, batch_size=[rows])
    our_parts, their_parts = ours.chunk(8), theirs.chunk(8)
    keys = ["input_ids", "attention_mask", "responses", "old_log_probs", "advantages"]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    return {
        "concat 8 -> 1": (lambda: DataProto.concat(our_parts), lambda: torch.cat(their_parts)),
        "chunk into 8": (lambda: ours.chunk(8), lambda: theirs.chunk(8)),
        "split into 16": (lambda: ours.split(rows // 16), lambda: theirs.split(rows // 16)),
        "select 5 keys": (lambda: ours.select(keys), lambda: theirs.select(*keys)),
        "index a permutation": (lambda: ours[order], lambda: theirs[order]),
        "to('cpu')": (lambda: ours.to("cpu"), lambda: theirs.to("cpu")),
    }


@ray.remote(num_cpus=0)
class Echo:
    def back(self, data):
        return data


def verl_default_bytes(batch: TensorDict) -> bytes:
    """verl's DataProto.__getstate__ default: one consolidated storage, written with torch.save."""
    buffer = io.BytesIO()
    torch.save(batch.contiguous().consolidate(), buffer)
    return buffer.getvalue()


def ray_round_trips(tensors: dict[str, torch.Tensor]) -> dict[str, object]:
    rows = len(next(iter(tensors.values())))
    echo = Echo.remote()
    ray.get(echo.back.remote(0))
    theirs = TensorDict(tensors, batch_size=[rows])
    return {
        "ours (flat byte views)": lambda: ray.get(echo.back.remote(DataProto(tensors))),
        "verl default (consolidate + torch.save)": lambda: torch.load(
            io.BytesIO(ray.get(echo.back.remote(verl_default_bytes(theirs)))), weights_only=False),
        "TensorDict's own pickling": lambda: ray.get(echo.back.remote(theirs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--response", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = ppo_batch(args.rows, args.prompt, args.response)
    megabytes = sum(value.numel() * value.element_size() for value in tensors.values()) / 2**20
    print(f"batch: {args.rows} rows x {args.prompt + args.response} tokens, {len(tensors)} keys, {megabytes:.0f} MiB; "
          f"median of {args.repeats} (ms)")
    print(f"{'operation':<24} {'ours':>9} {'tensordict':>11} {'ratio':>6}")
    for name, (ours, theirs) in local_operations(tensors).items():
        ours_s, theirs_s = paired_medians([ours, theirs], args.repeats)
        print(f"{name:<24} {ours_s * 1e3:9.3f} {theirs_s * 1e3:11.3f} {theirs_s / ours_s:6.2f}")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        print("Ray round trip to an actor and back (ms)")
        trips = ray_round_trips(tensors)
        for name, median in zip(trips, paired_medians(list(trips.values()), args.repeats)):
            print(f"  {name:<42} {median * 1e3:9.1f}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
