"""Which templates a run's held-out gain is made of: the share solved per template at two steps, for each seed.

    python recipes/qwen25_coder_gsm_symbolic/per_template.py DATA_DIR/test.parquet RUN_DIR... [--steps 0 25] \
        [--record benchmarks/results/NAME.json]

Each RUN_DIR holds a seed's validation answers, as `val_generations/<step>.jsonl` or packed in `val_generations.tgz`
(compare.sh). The answers carry no template, so they are matched to the test set's rows by position: the set's rows
are validated in file order, and each row's question must appear in its answer's prompt (else the error names the
row). Each answer is scored again with the recipe's reward (`solved`: right in the `#### N` format or by its last
number), so the totals equal the logged `eval/held_out/solved`; each seed's share of answers that open with `#### N`
before the working (`answer_first`, the shortcut's residue) is printed beside them. Why: 1,024 questions of only 17
templates, so a seed's gain can be a few templates that flipped (recipe README, "The comparison on 1,024 held-out
questions").
`--record` writes the table, those shares and each seed's solved rows into the variant's seed_table.py record: the
answers (1.5 MB a seed) stay out of the repository, whose working tree travels to the GPU host with every call, and
a workspace copy does not outlive its session, so the rows are what lets a later table, or a per-question pairing of
two variants, be made again.
"""
import argparse
import json
import math
import statistics
import tarfile
from pathlib import Path

import pandas as pd

from hybridrl.utils.import_utils import load_extern_object

REWARD_FILE = Path(__file__).resolve().parents[1] / "gsm_symbolic_reward.py"  # loaded as the trainer loads it


def read_answers(run_dir: Path, step: int) -> list[dict]:
    """One validation's answers, from the folder or the packed file."""
    name = f"val_generations/{step}.jsonl"
    if (run_dir / name).is_file():
        text = (run_dir / name).read_text()
    elif (run_dir / "val_generations.tgz").is_file():
        with tarfile.open(run_dir / "val_generations.tgz") as packed:
            try:
                text = packed.extractfile(name).read().decode()
            except KeyError:
                raise SystemExit(f"{run_dir}/val_generations.tgz: no {name}") from None
    else:
        raise SystemExit(f"{run_dir}: neither {name} nor val_generations.tgz")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def scored_rows(test: pd.DataFrame, answers: list[dict], compute_score, where: str) -> list[dict]:
    """The recipe reward's score and extras of each test row's answer; the test rows are found in `answers` from where
    the first row's question is, in order."""
    questions = [prompt[-1]["content"] for prompt in test["prompt"]]
    start = next((i for i, answer in enumerate(answers) if questions[0] in answer["input"]), None)
    if start is None or start + len(questions) > len(answers):
        raise SystemExit(f"{where}: the test set's {len(questions)} questions are not among its {len(answers)} answers")
    scored = []
    for row, (question, answer) in enumerate(zip(questions, answers[start:])):
        if question not in answer["input"]:
            raise SystemExit(f"{where}: answer {start + row} is not to the test set's row {row} ({question[:60]!r})")
        extra_info, ground_truth = dict(test["extra_info"][row]), test["reward_model"][row]["ground_truth"]
        scored.append(compute_score(test["data_source"][row], answer["output"], ground_truth, extra_info))
    return scored


def to_hex(solved: list[int]) -> str:
    """A validation's solved rows as hex digits, row 0 the first bit (a record keeps these, not the 1.5 MB answers)."""
    bits = "".join(map(str, solved)) + "0" * (-len(solved) % 4)
    return "".join(f"{int(bits[i:i + 4], 2):x}" for i in range(0, len(bits), 4))


def from_hex(digits: str, rows: int) -> list[int]:
    return [int(bit) for digit in digits for bit in f"{int(digit, 16):04b}"][:rows]


def score_runs(test: pd.DataFrame, run_dirs: list[Path], steps: tuple[int, int]) -> dict[tuple[int, int], list[dict]]:
    """(seed index, step) -> the score and extras of each test row, rescored from the run's answers."""
    compute_score = load_extern_object(str(REWARD_FILE), "compute_score")
    return {(seed, step): scored_rows(test, read_answers(run_dir, step), compute_score, f"{run_dir} step {step}")
            for seed, run_dir in enumerate(run_dirs) for step in steps}


def column(scores: dict[tuple[int, int], list[dict]], extra: str) -> dict[tuple[int, int], list[int]]:
    """(seed index, step) -> one extra (0/1) of each test row: `solved`, `answer_first`."""
    return {key: [int(row[extra]) for row in rows] for key, rows in scores.items()}


def answer_first_shares(answer_first: dict, run_dirs: list[Path], steps: tuple[int, int]) -> dict[str, dict]:
    """{seed's folder: {step: share of its answers that open with `#### N`}}."""
    return {run_dir.name: {str(step): float(statistics.mean(answer_first[seed, step])) for step in steps}
            for seed, run_dir in enumerate(run_dirs)}


def table(test: pd.DataFrame, solved: dict[tuple[int, int], list[int]], steps: tuple[int, int]) -> str:
    """Markdown: per template, its questions, the share solved at the first step (mean over seeds) and each seed's
    change to the second step, in points; the last row is the whole set."""
    templates = [info["template"] for info in test["extra_info"]]
    first, last = steps
    seeds = sorted({seed for seed, _ in solved})

    def share(seed: int, step: int, template) -> float:
        rows = [x for x, t in zip(solved[seed, step], templates) if template in ("all", t)]
        return statistics.mean(rows)

    lines = [f"| template | questions | step {first}, solved % | change to step {last}, points, each seed | mean |",
             "| --- | --- | --- | --- | --- |"]
    for template in sorted(set(templates)) + ["all"]:
        before = statistics.mean(share(s, first, template) for s in seeds)
        changes = [100 * (share(s, last, template) - share(s, first, template)) for s in seeds]
        size = len(templates) if template == "all" else templates.count(template)
        lines.append(f"| {template} | {size} | {100 * before:.1f} | " + ", ".join(f"{c:+.1f}" for c in changes)
                     + f" | {statistics.mean(changes):+.1f} |")
    return "\n".join(lines)


def flips(solved: dict[tuple[int, int], list[int]], run_dirs: list[Path], steps: tuple[int, int]) -> str:
    """Per seed, the questions solved at the second step but not the first and the reverse, with McNemar's z of the
    net change (the two shares are of the same questions, so they are compared pair by pair): a net gain is a
    balance of many questions won and lost."""
    first, last = steps
    lines = []
    for seed, run_dir in enumerate(run_dirs):
        pairs = list(zip(solved[seed, first], solved[seed, last]))
        gained, lost = pairs.count((0, 1)), pairs.count((1, 0))
        z = (gained - lost) / math.sqrt(gained + lost) if gained + lost else 0.0
        lines.append(f"{run_dir.name}: {gained} questions gained and {lost} lost from step {first} to {last} "
                     f"(net {gained - lost:+d}, McNemar z {z:.2f})")
    return "\n".join(lines)


def add_to_record(record: Path, run_dirs: list[Path], steps: tuple[int, int], solved: dict, markdown: str,
                  answer_first: dict) -> None:
    """The table, the flips, each seed's share of answers opening with `#### N` and every seed's solved rows at both
    steps (hex, `from_hex`) into a seed_table.py record."""
    data = json.loads(record.read_text())
    data["per_template"] = {
        "command": "python recipes/qwen25_coder_gsm_symbolic/per_template.py DATA_DIR/test.parquet "
                   + " ".join(d.name for d in run_dirs) + f" --steps {steps[0]} {steps[1]}",
        "table": markdown.splitlines(),
        "flips": flips(solved, run_dirs, steps).splitlines(),
        "answer_first": answer_first_shares(answer_first, run_dirs, steps),
        "solved_rows": "hex, one bit a row of test.parquet in file order, the first row the first bit (from_hex)",
        "solved": {run_dir.name: {str(step): to_hex(solved[seed, step]) for step in steps}
                   for seed, run_dir in enumerate(run_dirs)},
    }
    record.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test", type=Path, help="the held-out test set (test.parquet)")
    parser.add_argument("run_dirs", type=Path, nargs="+", help="one seed's run folder each")
    parser.add_argument("--steps", type=int, nargs=2, default=(0, 25), metavar=("FROM", "TO"))
    parser.add_argument("--record", type=Path,
                        help="also write the table, the answer_first shares and the solved rows into this record")
    args = parser.parse_args()
    steps, test = tuple(args.steps), pd.read_parquet(args.test)
    scores = score_runs(test, args.run_dirs, steps)
    solved, answer_first = column(scores, "solved"), column(scores, "answer_first")
    markdown = table(test, solved, steps)
    print(markdown)
    print(flips(solved, args.run_dirs, steps))
    for name, shares in answer_first_shares(answer_first, args.run_dirs, steps).items():
        print(f"{name}: answers opening with `#### N` before the working: "
              + ", ".join(f"{100 * share:.1f} % at step {step}" for step, share in shares.items()))
    if args.record:
        add_to_record(args.record, args.run_dirs, steps, solved, markdown, answer_first)


if __name__ == "__main__":
    main()
