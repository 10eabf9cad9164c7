"""recipes/qwen25_coder_gsm_symbolic/per_template.py: a held-out test set written by the data script, answers dumped
as the trainer dumps them (one seed's in a folder, one packed as compare.sh packs them), the per-template table
against a hand count."""
import collections
import json
import tarfile
from pathlib import Path

import pandas as pd
import pytest

from tests.test_data_preprocess import run_script
from tests.test_gsm_symbolic_verl_compare import load


@pytest.fixture(scope="module")
def per_template():
    return load("per_template")


@pytest.fixture(scope="module")
def test_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    result = run_script("reasoning_gym.py", "--task", "gsm_symbolic", "--size", "40", "--test_size", "12",
                        "--seed", "3", "--answer_format", "hash", "--drop_ungradeable", "--held_out_templates", "0.2",
                        "--local_dir", str(out), cwd=out)
    assert result.returncode == 0, result.stderr
    return out / "test.parquet"


def dump(path: Path, test: pd.DataFrame, outputs: list[str], step: int) -> None:
    """A validation's answers as the trainer writes them: another set's answer first, then the test set's in order."""
    prompts = ["user\nSome in-template question\nassistant\n"] + [
        f"system\nYou are Qwen.\nuser\n{prompt[-1]['content']}\nassistant\n" for prompt in test["prompt"]]
    lines = [json.dumps({"input": p, "output": o, "score": 0.0, "step": step})
             for p, o in zip(prompts, ["#### 1", *outputs])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def test_the_table_counts_each_templates_share_and_each_seeds_change(per_template, test_set, tmp_path):
    test = pd.read_parquet(test_set)
    truths = [model["ground_truth"] for model in test["reward_model"]]
    templates = [info["template"] for info in test["extra_info"]]
    first = templates[0]
    # step 0: every answer wrong. Step 25, seed A: the first template's questions right in the format, and the
    # last question right by its last number alone; seed B: only the test set's first question right, every answer
    # after its working (seed A's open with `#### N`, but for the last one).
    wrong = [f"#### {int(t) + 1}" for t in truths]
    seed_a = [f"#### {t}" if tm == first else w for t, tm, w in zip(truths, templates, wrong)]
    seed_a[-1] = f"So the answer is {truths[-1]}."
    seed_b = [f"First, 3 + 4 = 7.\n{answer}" for answer in [f"#### {truths[0]}"] + wrong[1:]]
    dump(tmp_path / "a" / "val_generations" / "0.jsonl", test, wrong, 0)
    dump(tmp_path / "a" / "val_generations" / "25.jsonl", test, seed_a, 25)
    dump(tmp_path / "b_raw" / "val_generations" / "0.jsonl", test, wrong, 0)
    dump(tmp_path / "b_raw" / "val_generations" / "25.jsonl", test, seed_b, 25)
    (tmp_path / "b").mkdir()
    with tarfile.open(tmp_path / "b" / "val_generations.tgz", "w:gz") as packed:  # compare.sh's packing
        packed.add(tmp_path / "b_raw" / "val_generations", arcname="val_generations")

    runs = [tmp_path / "a", tmp_path / "b"]
    scores = per_template.score_runs(test, runs, (0, 25))
    solved, answer_first = per_template.column(scores, "solved"), per_template.column(scores, "answer_first")
    markdown = per_template.table(test, solved, (0, 25))
    rows = markdown.splitlines()[2:]
    counts = collections.Counter(templates)
    by_template = {row.split(" | ")[0].strip("| "): row for row in rows}
    assert list(by_template) == [str(t) for t in sorted(counts)] + ["all"]
    last = templates[-1]
    for template, size in counts.items():
        a = 100.0 if template == first else 0.0
        if template == last and last != first:
            a = 100 / size
        b = 100 / size if template == first else 0.0
        assert by_template[str(template)] == f"| {template} | {size} | 0.0 | {a:+.1f}, {b:+.1f} | {(a + b) / 2:+.1f} |"
    right_a = counts[first] + (last != first)
    a_all, b_all = 100 * right_a / len(test), 100 / len(test)
    mean_all = (a_all + b_all) / 2
    assert by_template["all"] == f"| all | {len(test)} | 0.0 | {a_all:+.1f}, {b_all:+.1f} | {mean_all:+.1f} |"

    # per question: seed a won its right answers and lost none, seed b won one
    assert per_template.flips(solved, runs, (0, 25)).splitlines() == [
        f"a: {right_a} questions gained and 0 lost from step 0 to 25 (net +{right_a}, McNemar z {right_a ** 0.5:.2f})",
        "b: 1 questions gained and 0 lost from step 0 to 25 (net +1, McNemar z 1.00)"]

    # the record keeps each seed's solved rows, which give the same rows back
    record = tmp_path / "record.json"
    record.write_text(json.dumps({"what": "a seed table"}))
    per_template.add_to_record(record, runs, (0, 25), solved, markdown, answer_first)
    kept = json.loads(record.read_text())
    assert kept["what"] == "a seed table" and kept["per_template"]["table"] == markdown.splitlines()
    assert kept["per_template"]["flips"] == per_template.flips(solved, runs, (0, 25)).splitlines()
    n = len(test)
    assert kept["per_template"]["answer_first"] == {"a": {"0": 1.0, "25": (n - 1) / n}, "b": {"0": 1.0, "25": 0.0}}
    rows_of = {name: {int(step): per_template.from_hex(digits, len(test)) for step, digits in steps.items()}
               for name, steps in kept["per_template"]["solved"].items()}
    seed_a_rows = [int(tm == first) for tm in templates]
    seed_a_rows[-1] = 1
    seed_b_rows = [1] + [0] * (len(test) - 1)
    assert rows_of == {"a": {0: [0] * len(test), 25: seed_a_rows}, "b": {0: [0] * len(test), 25: seed_b_rows}}
    # by hand: 101100001 padded to 1011 0000 1000
    assert per_template.to_hex([1, 0, 1, 1, 0, 0, 0, 0, 1]) == "b08"
    assert per_template.from_hex("b08", 9) == [1, 0, 1, 1, 0, 0, 0, 0, 1]


def test_an_answer_to_another_question_is_named_by_its_row(per_template, test_set, tmp_path):
    test = pd.read_parquet(test_set)
    dump(tmp_path / "a" / "val_generations" / "0.jsonl", test, ["#### 0"] * len(test), 0)
    lines = (tmp_path / "a" / "val_generations" / "0.jsonl").read_text().splitlines()
    lines[3] = json.dumps({"input": "user\nAnother question\nassistant\n", "output": "#### 0", "score": 0.0})
    (tmp_path / "a" / "val_generations" / "0.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match=r"step 0: answer 3 is not to the test set's row 2"):
        per_template.score_runs(test, [tmp_path / "a"], (0, 25))
    with pytest.raises(SystemExit, match=r"neither val_generations/0.jsonl nor val_generations.tgz"):
        per_template.score_runs(test, [tmp_path / "missing"], (0, 25))
