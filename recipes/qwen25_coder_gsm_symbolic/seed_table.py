"""One variant's seed table: the JSON record and the README's markdown rows, from the seeds' copied-back logs.

    python recipes/qwen25_coder_gsm_symbolic/seed_table.py DIR VARIANT --model 0.5b --commit C --date D \
        --card "..." --command "..." --out benchmarks/results/NAME.json

DIR holds `<MODEL>_<VARIANT>_seed<N>.metrics.jsonl` and `.summary.json` as `compare.sh` names its run folders. The
table is mean ± sd over the seeds at the validation steps (0, 5, ..., 25), never a best step (issue 60).
"""
import argparse
import json
import re
import statistics
from pathlib import Path

HEADLINE = "eval/held_out/last_number_right"
COLUMNS = (HEADLINE, "eval/held_out/acc", "eval/in_template/last_number_right", "eval/in_template/acc")
VERSIONS = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "sglang": "0.5.16", "ray": "2.60.0", "hydra-core": "1.3.8"}


def read_seed(metrics_path: Path) -> dict:
    """A seed's validations by step, its summary, median step time, peak memory and sampled answer lengths."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    validation = {str(r["step"]): {k: v for k, v in r.items() if k.startswith("eval/")}
                  for r in records if HEADLINE in r}
    training = [r for r in records if "response_length/mean" in r]
    summary_path = metrics_path.with_name(metrics_path.name.replace(".metrics.jsonl", ".summary.json"))
    return {
        "validation": validation,
        "summary": json.loads(summary_path.read_text()),
        "step_time_s_median": statistics.median(r["timing_s/step"] for r in training),
        "peak_memory_allocated_gib": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in training),
        "train_response_length_by_step": [round(r["response_length/mean"], 1) for r in training],
    }


def mean_sd(seeds: dict, metric: str) -> dict:
    """{step: per-seed values, mean, sd} for the steps every seed validated at."""
    steps = sorted(set.intersection(*(set(s["validation"]) for s in seeds.values())), key=int)
    table = {}
    for step in steps:
        values = [s["validation"][step][metric] for s in seeds.values()]
        table[step] = {"per_seed": values, "mean": statistics.mean(values),
                       "sd": statistics.stdev(values) if len(values) > 1 else 0.0}
    return table


def markdown(table: dict) -> str:
    """The README's rows: step | headline mean ± sd (per seed) | the other columns' mean ± sd, in %."""
    lines = ["| step | held-out, format-free (headline) | held-out, task (`#### N` right) "
             "| in-template, format-free | in-template, task |", "| --- | --- | --- | --- | --- |"]
    for step in table[HEADLINE]:
        cells = []
        for metric in COLUMNS:
            cell = table[metric][step]
            text = f"{100 * cell['mean']:.1f} ± {100 * cell['sd']:.1f}"
            if metric == HEADLINE:
                text += " (" + ", ".join(f"{100 * v:.1f}" for v in cell["per_seed"]) + ")"
            cells.append(text)
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path)
    parser.add_argument("variant")
    parser.add_argument("--model", default="0.5b")
    for key in ("commit", "date", "card", "command", "what"):
        parser.add_argument(f"--{key}", required=key != "what", default="")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pattern = re.compile(rf"{re.escape(args.model)}_{re.escape(args.variant)}_seed(\d+)\.metrics\.jsonl")
    seeds = {m.group(1): read_seed(path) for path in sorted(args.dir.iterdir()) if (m := pattern.fullmatch(path.name))}
    if not seeds:
        raise SystemExit(f"{args.dir}: no {args.model}_{args.variant}_seed<N>.metrics.jsonl")
    table = {metric: mean_sd(seeds, metric) for metric in COLUMNS}
    record = {"what": args.what or f"issue 60 item 3: compare.sh {args.variant}, MODEL={args.model}, seeds "
                                    + ", ".join(seeds),
              "command": args.command, "date": args.date, "commit": args.commit, "card": args.card,
              "versions": VERSIONS, "table_mean_sd": table, "seeds": seeds}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(markdown(table))


if __name__ == "__main__":
    main()
