"""One variant's seed table: the JSON record and the README's markdown rows, from the seeds' copied-back logs.

    python recipes/qwen25_coder_gsm_symbolic/seed_table.py DIR VARIANT --model 0.5b --commit C --date D \
        --card "..." --command "..." --out benchmarks/results/NAME.json
    python recipes/qwen25_coder_gsm_symbolic/seed_table.py DIR verl --trainer verl ...    # verl_compare.py's seeds

DIR holds each seed's run folder `<MODEL>_<VARIANT>_seed<N>/` with its `metrics.jsonl` and `summary.json`, as
`compare.sh` (and verl_compare.py) name them and `host_seeds.sh pack` copies them back. The table is mean ± sd over
the seeds at the validation steps (0, 5, ..., 25), never a best step (issue 60), with the training time to each step
beside it (the sum of timing_s/step so far: both trainers time a step without its validation). `--trainer verl` reads
verl's file logger ({"step": N, "data": {...}} a line) with verl's metric names mapped to the recipe's
(VERL_METRICS); a column no seed's log has (verl validates only the held-out set) shows as "-".

A seed cut off with its lease (no summary.json) is refused, unless `--cut-off`: then it is kept, marked in the
record with the last step it trained, and the table holds the validations every seed reached. For a record of what
a lease did run; a seed table for the README's comparisons has whole seeds only.
"""
import argparse
import json
import re
import statistics
from pathlib import Path

# solved: right in the format or as the answer's last number (recipes/gsm_symbolic_reward.py); runs before
# 2026-12-07 logged no `solved` and validated 256 held-out questions, and this table is not for them
HEADLINE = "eval/held_out/solved"
COLUMNS = (HEADLINE, "eval/held_out/last_number_right", "eval/held_out/acc", "eval/in_template/solved",
           "eval/in_template/acc")
VERSIONS = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "sglang": "0.5.16", "ray": "2.60.0",
            "hydra-core": "1.3.8"}
VERL_VERSIONS = "verl 0.9.1 in its own site, with the transformers it pins (benchmarks/vs_verl.py's VERL_TF_SITE)"
# verl 0.9.1's names (val-core/val-aux/<data_source>/<reward key>/mean@1: greedy, one answer a question; "acc" is its
# core variable when the reward returns one) for the recipe's; verl validates the held-out set alone (verl_compare.py)
VERL_DATA_SOURCE = "reasoning_gym/gsm_symbolic"
VERL_METRICS = {
    "eval/held_out/last_number_right": f"val-aux/{VERL_DATA_SOURCE}/last_number_right/mean@1",
    "eval/held_out/acc": f"val-core/{VERL_DATA_SOURCE}/acc/mean@1",
    "eval/held_out/solved": f"val-aux/{VERL_DATA_SOURCE}/solved/mean@1",
    "eval/held_out/formatted": f"val-aux/{VERL_DATA_SOURCE}/formatted/mean@1",
    "eval/held_out/answer_first": f"val-aux/{VERL_DATA_SOURCE}/answer_first/mean@1",
    "eval/held_out": f"val-aux/{VERL_DATA_SOURCE}/reward/mean@1",  # the task's score
    "perf/max_memory_allocated_gb": "actor/perf/max_memory_allocated_gb",
}


def verl_record(line: dict) -> dict:
    """One line of verl's file logger as a step's metrics under the recipe's names."""
    metrics = {"step": line["step"], **line["data"]}
    return {**metrics, **{ours: metrics[theirs] for ours, theirs in VERL_METRICS.items() if theirs in metrics}}


READERS = {"hybridrl": lambda line: line, "verl": verl_record}


def read_summary(run_dir: Path) -> dict | None:
    """The summary a run writes when it ends, or None: a seed cut off (its lease ended, host_seeds.sh packed it
    running) has none, which main refuses unless --cut-off. One that failed says so and is refused here, so no table
    averages a failed run with whole ones."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    if summary.get("returncode", 0) != 0 or summary.get("stopped_early"):
        raise SystemExit(f"{path}: the run did not finish (returncode {summary.get('returncode', 0)}, stopped_early "
                         f"{summary.get('stopped_early', False)})")
    return summary


def read_seed(run_dir: Path, trainer: str = "hybridrl") -> dict:
    """A seed's validations by step, the training seconds to each of them, its summary (None: cut off), the last step
    it trained, median step time, peak memory and sampled answer lengths."""
    metrics_path = run_dir / "metrics.jsonl"
    records = [READERS[trainer](json.loads(line)) for line in metrics_path.read_text().splitlines() if line.strip()]
    validation = {str(r["step"]): {k: v for k, v in r.items() if k.startswith("eval/")}
                  for r in records if HEADLINE in r}
    if not validation:
        raise SystemExit(f"{metrics_path}: no validation logged {HEADLINE} (runs before 2026-12-07 did not)")
    training = sorted((r for r in records if "response_length/mean" in r), key=lambda r: r["step"])
    return {
        "validation": validation,
        "train_s_to_step": {step: sum(r["timing_s/step"] for r in training if r["step"] <= int(step))
                            for step in validation},
        "summary": read_summary(run_dir),
        "last_step_trained": training[-1]["step"],  # a seed with no training step fails the median below
        "step_time_s_median": statistics.median(r["timing_s/step"] for r in training),
        "peak_memory_allocated_gib": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in training),
        "train_response_length_by_step": [round(r["response_length/mean"], 1) for r in training],
    }


def mean_sd(seeds: dict, metric: str) -> dict:
    """{step: per-seed values, mean, sd} for the steps every seed validated at; `metric` "train_s_to_step": the
    training seconds to that step."""
    steps = sorted(set.intersection(*(set(s["validation"]) for s in seeds.values())), key=int)
    table = {}
    for step in steps:
        values = [s["train_s_to_step"][step] if metric == "train_s_to_step" else s["validation"][step][metric]
                  for s in seeds.values()]
        table[step] = {"per_seed": values, "mean": statistics.mean(values),
                       "sd": statistics.stdev(values) if len(values) > 1 else 0.0}
    return table


def markdown(table: dict) -> str:
    """The README's rows: step | headline mean ± sd (per seed) | the other columns' mean ± sd, in % ("-" for a
    column the logs lack) | training seconds to the step, mean ± sd."""
    lines = ["| step | held-out, solved (headline) | held-out, last number right | held-out, task (`#### N` right) "
             "| in-template, solved | in-template, task | training s to the step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for step in table[HEADLINE]:
        cells = []
        for metric in COLUMNS:
            if metric not in table:
                cells.append("-")
                continue
            cell = table[metric][step]
            text = f"{100 * cell['mean']:.1f} ± {100 * cell['sd']:.1f}"
            if metric == HEADLINE:
                text += " (" + ", ".join(f"{100 * v:.1f}" for v in cell["per_seed"]) + ")"
            cells.append(text)
        time_cell = table["train_s_to_step"][step]
        cells.append(f"{time_cell['mean']:.0f} ± {time_cell['sd']:.0f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("variant")
    parser.add_argument("--model", default="0.5b")
    parser.add_argument("--trainer", choices=sorted(READERS), default="hybridrl",
                        help="whose logs: verl reads verl's file logger (verl_compare.py's runs)")
    parser.add_argument("--cut-off", action="store_true",
                        help="keep seeds cut off with their lease (no summary.json): the table holds the validations "
                             "every seed reached")
    for key in ("commit", "date", "card", "command", "what"):
        parser.add_argument(f"--{key}", required=key != "what", default="")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pattern = re.compile(rf"{re.escape(args.model)}_{re.escape(args.variant)}_seed(\d+)")
    run_dirs = {int(m.group(1)): path for path in args.dir.iterdir() if (m := pattern.fullmatch(path.name))}
    seeds = {str(seed): read_seed(run_dirs[seed], args.trainer) for seed in sorted(run_dirs)}
    if not seeds:
        raise SystemExit(f"{args.dir}: no {args.model}_{args.variant}_seed<N>/")
    cut = {seed: values["last_step_trained"] for seed, values in seeds.items() if values["summary"] is None}
    if cut and not args.cut_off:
        raise SystemExit(f"{run_dirs[int(next(iter(cut)))] / 'summary.json'}: missing, so the run did not end (cut off "
                         "with its lease?): run the seed again, or move its folder out of DIR (or --cut-off, for a "
                         "record of what ran)")
    steps = {seed: sorted(values["validation"], key=int) for seed, values in seeds.items()}
    if len({tuple(validated) for seed, validated in steps.items() if seed not in cut}) > 1:  # among whole seeds
        raise SystemExit("the seeds validated at different steps, so their means would mix: " + "; ".join(
            f"seed {seed} at {', '.join(validated)}" for seed, validated in steps.items()))
    logged = [metric for metric in COLUMNS  # a column every seed's every validation has
              if all(metric in values for seed in seeds.values() for values in seed["validation"].values())]
    table = {metric: mean_sd(seeds, metric) for metric in [*logged, "train_s_to_step"]}
    if args.trainer == "verl":
        source, versions = "issue 59 item 3: verl_compare.py (verl 0.9.1)", VERL_VERSIONS
    else:
        source, versions = f"issue 60 item 3: compare.sh {args.variant}", VERSIONS
    what = args.what or f"{source}, MODEL={args.model}, seeds " + ", ".join(seeds)
    if cut:
        what += "; cut off with the lease: " + ", ".join(f"seed {seed} after step {step}" for seed, step in cut.items())
    record = {"what": what, "cut_off_after_step": cut,
              "variant": args.variant, "model": args.model, "trainer": args.trainer, "command": args.command,
              "date": args.date, "commit": args.commit, "card": args.card, "versions": versions,
              "table_mean_sd": table, "seeds": seeds}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(markdown(table))


if __name__ == "__main__":
    main()
