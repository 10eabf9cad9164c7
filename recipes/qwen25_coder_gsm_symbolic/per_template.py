"""Which templates a run's held-out gain is made of: the share solved per template at two steps, for each seed.

    python recipes/qwen25_coder_gsm_symbolic/per_template.py DATA_DIR/test.parquet RUN_DIR... [--steps 0 25]

Each RUN_DIR holds a seed's validation answers, as `val_generations/<step>.jsonl` or packed in `val_generations.tgz`
(compare.sh). The answers carry no template, so they are matched to the test set's rows by position: the set's rows
are validated in file order, and each row's question must appear in its answer's prompt (else the error names the
row). Each answer is scored again with the recipe's reward (`solved`: right in the `#### N` format or by its last
number), so the totals equal the logged `eval/held_out/solved`. Why: 1,024 questions of only 17 templates, so a seed's
gain can be a few templates that flipped (recipe README, "The comparison on 1,024 held-out questions").
"""
import argparse
import collections
import json
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


def solved_by_template(test: pd.DataFrame, answers: list[dict], compute_score, where: str) -> dict[int, list[float]]:
    """{template: solved (0/1) of each of its questions}; the test rows are found in `answers` from where the first
    row's question is, in order."""
    questions = [prompt[-1]["content"] for prompt in test["prompt"]]
    start = next((i for i, answer in enumerate(answers) if questions[0] in answer["input"]), None)
    if start is None or start + len(questions) > len(answers):
        raise SystemExit(f"{where}: the test set's {len(questions)} questions are not among its {len(answers)} answers")
    solved = collections.defaultdict(list)
    for row, (question, answer) in enumerate(zip(questions, answers[start:])):
        if question not in answer["input"]:
            raise SystemExit(f"{where}: answer {start + row} is not to the test set's row {row} ({question[:60]!r})")
        extra_info, ground_truth = dict(test["extra_info"][row]), test["reward_model"][row]["ground_truth"]
        score = compute_score(test["data_source"][row], answer["output"], ground_truth, extra_info)
        solved[extra_info["template"]].append(score["solved"])
    return solved


def table(test_path: Path, run_dirs: list[Path], steps: tuple[int, int]) -> str:
    """Markdown: per template, its questions, the share solved at the first step (mean over seeds) and each seed's
    change to the second step, in points; the last row is the whole set."""
    test, compute_score = pd.read_parquet(test_path), load_extern_object(str(REWARD_FILE), "compute_score")
    solved = {}  # (seed index, step) -> {template: solved of each question}, with "all" for the whole set
    for seed, run_dir in enumerate(run_dirs):
        for step in steps:
            by_template = solved_by_template(test, read_answers(run_dir, step), compute_score, f"{run_dir} step {step}")
            solved[seed, step] = {**by_template, "all": [x for v in by_template.values() for x in v]}
    first, last = steps
    seeds = range(len(run_dirs))
    lines = [f"| template | questions | step {first}, solved % | change to step {last}, points, each seed | mean |",
             "| --- | --- | --- | --- | --- |"]
    for template in sorted(t for t in solved[0, first] if t != "all") + ["all"]:
        before = statistics.mean(statistics.mean(solved[s, first][template]) for s in seeds)
        changes = [100 * (statistics.mean(solved[s, last][template]) - statistics.mean(solved[s, first][template]))
                   for s in seeds]
        size = len(solved[0, first][template])
        lines.append(f"| {template} | {size} | {100 * before:.1f} | " + ", ".join(f"{c:+.1f}" for c in changes)
                     + f" | {statistics.mean(changes):+.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("test", type=Path, help="the held-out test set (test.parquet)")
    parser.add_argument("run_dirs", type=Path, nargs="+", help="one seed's run folder each")
    parser.add_argument("--steps", type=int, nargs=2, default=(0, 25), metavar=("FROM", "TO"))
    args = parser.parse_args()
    print(table(args.test, args.run_dirs, tuple(args.steps)))


if __name__ == "__main__":
    main()
