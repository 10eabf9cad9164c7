"""A change's before and after on one machine: one benchmark script run from two source trees in turns, A B B A.

    python3 benchmarks/tree_turns.py --before /tmp/before --after /tmp/hrl --out DIR -- \
        benchmarks/ppo_step.py --data-dir D --tokenizer T --shape 0.5b --gpus 1 --layouts rmpad32k --steps 4

Each turn runs `python3 SCRIPT ARGS --out DIR/<side><turn>.json` with that tree as the working directory and first on
PYTHONPATH, so each side runs its own code and its own copy of the script (the script must take the same arguments
in both trees). ppo_step.py records each run's steps after its first (the warm-up) under `steps/timing_s/<phase>`;
DIR/tree_turns.json collects them per side after every turn, with per phase the medians of the pooled steps and
after/before as a ratio of medians and of totals (times, not rates). Turns alternate so that a machine drifting
warmer or busier over the lease weighs on both sides alike.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PHASES = ("step", "gen", "reward", "old_log_prob", "update_actor")  # those a tree's ppo_step.py records per step
ORDER = ("before", "after", "after", "before")


def steps_of(record: dict) -> dict[str, list[float]]:
    """Every run's steady steps in one ppo_step.py record, per phase, pooled over its layouts."""
    pooled: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for name, run in record.get("results", {}).items():
        for phase in PHASES:
            pooled[phase].extend(run.get(f"steps/timing_s/{phase}", []) if isinstance(run, dict) else [])
    return pooled


def summarise(turns: list[dict]) -> dict:
    """Per side the pooled steps; per phase the medians and after/before (ratio of medians, ratio of totals)."""
    sides = {side: {phase: [] for phase in PHASES} for side in ("before", "after")}
    for turn in turns:
        for phase, seconds in turn["steps"].items():
            sides[turn["side"]][phase].extend(seconds)
    sides = {side: {phase: seconds for phase, seconds in phases.items() if seconds} for side, phases in sides.items()}
    ratios = {}
    for phase in PHASES:
        before, after = sides["before"].get(phase), sides["after"].get(phase)
        if before and after:
            ratios[phase] = {"median_before_s": statistics.median(before), "median_after_s": statistics.median(after),
                             "after_over_before_median": statistics.median(after) / statistics.median(before),
                             "after_over_before_total": (sum(after) / len(after)) / (sum(before) / len(before)),
                             "steps": [len(before), len(after)]}
    return {"steps": sides, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the tree before the change")
    parser.add_argument("--after", required=True, help="the tree after the change")
    parser.add_argument("--out", required=True, help="directory for each turn's record and tree_turns.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS (SCRIPT relative to each tree)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("tree_turns.py: expected -- SCRIPT ARGS after the options")
    os.makedirs(args.out, exist_ok=True)
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    turns = []
    for index, side in enumerate(ORDER, start=1):
        out = os.path.join(os.path.abspath(args.out), f"{side}{index}.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [trees[side], os.environ.get("PYTHONPATH")]))}
        print(f"turn {index}: {side} ({trees[side]})", flush=True)
        exit_code = subprocess.call([sys.executable, *command, "--out", out], cwd=trees[side], env=env)
        record = json.load(open(out)) if os.path.isfile(out) else {}
        turns.append({"side": side, "tree": trees[side], "exit": exit_code, "steps": steps_of(record)})
        summary = {"command": command, "order": list(ORDER), "turns": turns, **summarise(turns)}
        with open(os.path.join(args.out, "tree_turns.json"), "w") as f:
            json.dump(summary, f, indent=1)
    for phase, ratio in summary["ratios"].items():
        print(f"{phase}: before {ratio['median_before_s']:.3f} s, after {ratio['median_after_s']:.3f} s (medians of "
              f"{ratio['steps'][0]} and {ratio['steps'][1]} steps); after/before {ratio['after_over_before_median']:.3f}"
              f" of medians, {ratio['after_over_before_total']:.3f} of totals")


if __name__ == "__main__":
    main()
