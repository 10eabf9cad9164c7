"""Where a training step's time goes that is not the workers' own compute (issue 58): the controller's share.

    PYTHONPATH=. python benchmarks/controller_overhead.py [--steps 12] [--out FILE] [hydra overrides ...]

It runs the embedded default (`python -m hybridrl.main_ppo` with no overrides: GRPO, `hf` rollout, 2 CPU ranks),
without validation or checkpoints, on a Ray cluster started and joined as main_ppo does it (LocalRayCluster), the
trainer in a Ray actor of no CPU as main_ppo's TaskRunner runs it, and reads Ray's timeline of the workers' calls
afterwards. For every step after the first (warm-up):

- `cycle`: from the start of one step's first worker call to the start of the next step's (everything the loop does
  once per step, the data loading, metrics and logging between steps included);
- per worker call (rollout_mode, generate_sequences, trainer_mode, compute_log_prob, update_actor): the controller's
  `timing_s/<phase>` and the workers' execution of it (the slower rank's, from the timeline), whose difference is
  the call's dispatch: planning, serialising, Ray's round trip, gathering;
- `controller_s`: the cycle less the workers' executions, i.e. everything the controller did or waited on that was
  not a worker computing (the issue's "non-compute part"); the controller's own phases (reward, adv) are in it.

Medians over the steps are printed as a markdown table and written to `--out` as JSON. The machine's load moves
such numbers, so compare two trees in turns (A B B A) on one machine and compare ratios, not single runs.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

# The worker calls of one default step, in order, by the controller's timing key.
CALLS = {"rollout_mode": "rollout_mode", "gen": "generate_sequences", "trainer_mode": "trainer_mode",
         "old_log_prob": "compute_log_prob", "update_actor": "update_actor"}
FIRST_CALL = "rollout_mode"


class Runner:
    """The controller process, as main_ppo's TaskRunner: builds the trainer and runs its loop."""

    def run(self, config) -> None:
        from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer

        trainer = RayPPOTrainer(config)
        trainer.init_workers()
        try:
            trainer.fit()
        finally:
            trainer.shutdown()


def run_default(steps: int, run_dir: str, overrides: list[str]) -> str:
    """Run the default for `steps` steps on a Ray cluster started as main_ppo starts it; returns the path of Ray's
    timeline of it."""
    from hybridrl.single_controller.local_cluster import LocalRayCluster, prepare_driver_process

    prepare_driver_process(None)
    import ray  # only now, as in main_ppo

    import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
    from hybridrl.config import compose_config, validate_config
    from hybridrl.defaults.assets import ensure_default_assets

    config = validate_config(compose_config([
        f"trainer.default_local_dir={run_dir}", "trainer.logger=[console,jsonl]",
        f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", *overrides]))
    ensure_default_assets(config)
    python_path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    cluster = LocalRayCluster(2, None, include_dashboard=False, start_timeout_s=600)
    ray.init(address=cluster.start(),
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": python_path}})
    try:
        runner = ray.remote(num_cpus=0)(Runner).remote()
        ray.get(runner.run.remote(config))
        timeline_path = os.path.join(run_dir, "timeline.json")
        ray.timeline(timeline_path)
    finally:
        ray.shutdown()
        cluster.stop()
    return timeline_path


def worker_calls(timeline_path: str) -> list[tuple[str, float, float]]:
    """(method, start, seconds of the slower rank) of each group call of the policy workers, in call order."""
    with open(timeline_path) as f:
        events = json.load(f)
    by_rank = collections.defaultdict(list)
    for event in events:
        name = event["name"]
        if event["cat"].startswith("task::Colocated") and any(name.endswith(method) for method in CALLS.values()):
            by_rank[event["tid"]].append(event)
    ranks = [sorted(calls, key=lambda event: event["ts"]) for calls in by_rank.values()]
    calls = []
    for same_call in zip(*ranks):
        names = {event["name"] for event in same_call}
        if len(names) != 1:
            raise ValueError(f"{timeline_path}: the ranks' calls are out of step: {names}")
        name = names.pop()
        method = next(method for method in CALLS.values() if name.endswith(method))
        calls.append((method, min(event["ts"] for event in same_call) / 1e6,
                      max(event["dur"] for event in same_call) / 1e6))
    return calls


def step_breakdown(calls: list[tuple[str, float, float]], metrics: list[dict]) -> list[dict[str, float]]:
    """One dict per step with a next step (so not the last), seconds by phase (see the module docstring)."""
    starts = [index for index, (method, _, _) in enumerate(calls) if method == CALLS[FIRST_CALL]]
    if len(starts) != len(metrics):
        raise ValueError(f"{len(starts)} steps in the timeline, {len(metrics)} in metrics.jsonl")
    steps = []
    for step, (begin, end) in enumerate(zip(starts, starts[1:])):
        step_calls = calls[begin:end]
        executed = {method: seconds for method, _, seconds in step_calls}
        if len(executed) != len(step_calls) or set(executed) != set(CALLS.values()):
            raise ValueError(f"step {step + 1}: expected one call each of {list(CALLS.values())}, got "
                             f"{[method for method, _, _ in step_calls]}")
        cycle = calls[end][1] - calls[begin][1]
        row = {"cycle": cycle, "step": metrics[step]["timing_s/step"],
               "workers_executing": sum(executed.values())}
        row["controller_s"] = cycle - row["workers_executing"]
        for phase, method in CALLS.items():
            row[f"{phase}/controller"] = metrics[step][f"timing_s/{phase}"]
            row[f"{phase}/workers"] = executed[method]
            row[f"{phase}/dispatch"] = row[f"{phase}/controller"] - executed[method]
        row["reward"] = metrics[step]["timing_s/reward"]
        row["adv"] = metrics[step]["timing_s/adv"]
        row["between_steps"] = cycle - row["step"]
        steps.append(row)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps (the first is not counted)")
    parser.add_argument("--out", help="write the medians and every step's breakdown here (JSON)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides on top of the default")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: the first step is a warm-up and the last has no next step")

    run_dir = tempfile.mkdtemp(prefix="hybridrl-controller-overhead-")
    started = time.perf_counter()
    timeline_path = run_default(args.steps, run_dir, args.overrides)
    wall_s = time.perf_counter() - started
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    steps = step_breakdown(worker_calls(timeline_path), metrics)[1:]  # step 1 warms up
    medians = {key: statistics.median(step[key] for step in steps) for key in steps[0]}
    print(f"\nmedian over steps 2..{args.steps - 1} (load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} CPUs), seconds:\n\n| phase | seconds |\n| --- | --- |")
    for key, value in medians.items():
        print(f"| {key} | {value:.4f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "wall_s": wall_s, "load_average_after": os.getloadavg()[0],
                       "median": medians, "steps": steps,
                       "losses": [{key: value for key, value in step.items()
                                   if key.startswith(("actor/", "critic/"))} for step in metrics]}, f, indent=1)


if __name__ == "__main__":
    main()
