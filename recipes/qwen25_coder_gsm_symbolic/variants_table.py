"""Issue 60's one table: every variant's held-out share solved at the fixed steps, from their seed_table.py records.

    python recipes/qwen25_coder_gsm_symbolic/variants_table.py \
        benchmarks/results/recipe_qwen25_coder_*_heldout1024_*.json

A row a record: mean ± sd over its seeds at steps 0, 5, ..., 25 (never a best step), each seed's gain at the last
step, how many seeds reached the issue's target (+5 points at 0.5B, +20 at 1.5B) and how many ended below their
start, the shortest mean sampled answer of any seed (a collapse to `#### N` shows as a few tokens), and each seed's
share of greedy held-out answers that open with `#### N` before the working at the last step (what the collapse leaves
once the answers are long again: `answer_first` of recipes/gsm_symbolic_reward.py, logged by the seeds' validations,
or counted by per_template.py --record from the answers of seeds that ran before it was logged; "-" where neither).
"""
import argparse
import json
from pathlib import Path

from hybridrl.utils.import_utils import load_extern_object

HEADLINE = load_extern_object(str(Path(__file__).with_name("seed_table.py")), "HEADLINE")  # the records' headline
ANSWER_FIRST = "eval/held_out/answer_first"
TARGET_POINTS = {"0.5b": 5.0, "1.5b": 20.0}  # issue 60 item 4: every seed's gain at step 25


def row(record: dict) -> str:
    """One record's markdown row."""
    variant, model = record["variant"], record["model"]
    table = record["table_mean_sd"][HEADLINE]
    steps = list(table)
    first, last = table[steps[0]]["per_seed"], table[steps[-1]]["per_seed"]
    gains = [100 * (b - a) for a, b in zip(first, last)]
    cells = [f"{100 * table[step]['mean']:.1f} ± {100 * table[step]['sd']:.1f}" for step in steps]
    reached = sum(gain >= TARGET_POINTS[model] for gain in gains)
    below = sum(gain < 0 for gain in gains)
    shortest = min(min(seed["train_response_length_by_step"]) for seed in record["seeds"].values())
    return (f"| `{variant}` | {model} | " + " | ".join(cells) + " | " + ", ".join(f"{g:+.1f}" for g in gains)
            + f" | {reached} of {len(gains)} | {below} | {shortest:.1f} | {answer_first(record, steps[-1])} |")


def answer_first(record: dict, step: str) -> str:
    """Each seed's share of answers opening with `#### N` at `step`, in %: from its validation's log, else from
    per_template.py's count of its answers; "-" if neither has every seed."""
    logged = [seed["validation"][step].get(ANSWER_FIRST) for seed in record["seeds"].values()]
    counted = list(record.get("per_template", {}).get("answer_first", {}).values())
    if None not in logged:
        shares = logged
    elif len(counted) == len(logged) and all(step in seed for seed in counted):
        shares = [seed[step] for seed in counted]
    else:
        return "-"
    return ", ".join(f"{100 * share:.0f}" for share in shares)


def table(records: list[dict]) -> str:
    steps = list(records[0]["table_mean_sd"][HEADLINE])
    if any(list(r["table_mean_sd"][HEADLINE]) != steps for r in records):
        raise SystemExit(f"the records validated at different steps; expected {steps} in each")
    header = ("| variant | model | " + " | ".join(f"step {s}" for s in steps)
              + f" | gain at step {steps[-1]}, each seed | seeds at the target | seeds below start "
              "| shortest sampled answer, tokens | answers opening with `#### N`, % |")
    return "\n".join([header, "|" + " --- |" * (len(steps) + 7), *map(row, records)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("records", type=Path, nargs="+", help="seed_table.py records (benchmarks/results/*.json)")
    args = parser.parse_args()
    records = []
    for path in args.records:
        record = json.loads(path.read_text())
        if HEADLINE not in record.get("table_mean_sd", {}):
            raise SystemExit(f"{path}: no {HEADLINE} table (records before 2026-12-07 validated 256 questions)")
        records.append(record)
    print(table(records))


if __name__ == "__main__":
    main()
