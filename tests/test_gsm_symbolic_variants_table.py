"""recipes/qwen25_coder_gsm_symbolic/variants_table.py: issue 60's one table, from records that seed_table.py made of
hand-written logs, against a hand count."""
import json
import subprocess
import sys

import pytest

from tests.test_gsm_symbolic_verl_compare import RECIPE, load, seed_table, write_run


def write_seed(folder, name: str, solved: tuple[float, float], lengths: tuple[float, float],
               answer_first: float | None = None) -> None:
    """A seed's run folder, its metrics.jsonl as the trainer logs it: validations at steps 0 and 2 (with the share of
    answers opening with `#### N` when given, as runs log it since it is an extra of the recipe's reward), training
    steps 1 and 2."""
    def evals(value: float) -> dict:
        logged = {} if answer_first is None else {"eval/held_out/answer_first": answer_first}
        return {"eval/held_out/solved": value, "eval/held_out/last_number_right": value, "eval/held_out/acc": value,
                **logged}

    lines = [{"step": 0, **evals(solved[0])},
             {"step": 1, "timing_s/step": 9.0, "response_length/mean": lengths[0]},
             {"step": 2, "timing_s/step": 9.0, "response_length/mean": lengths[1], **evals(solved[1])}]
    write_run(folder, name, lines, {"wall_s": 30.0})


def make_record(folder, variant: str, model: str, out) -> None:
    result = seed_table(folder, variant, out, "--model", model)
    assert result.returncode == 0, result.stderr


def test_each_variant_is_a_row_of_means_gains_and_the_target_counted_per_seed(tmp_path):
    """By hand. `a` at 0.5B: solved 0.20 -> 0.26 / 0.30 / 0.19, so gains +6.0, +10.0, -1.0 points: two at the +5
    target, one below its start; step 2 mean 0.25, sd of (.01, .05, -.06) = sqrt(.0062 / 2) = 5.6 points; shortest
    sampled answer 30.0 tokens. `b` at 1.5B: 0.40 -> 0.61 / 0.59, gains +21.0 and +19.0: one at the +20 target.
    Answers opening with `#### N` at step 2: `b`'s seeds logged 0.25 each; `a`'s did not, and its record's
    per_template.py count says 0.5, 0 and 1 (as --record writes it); a record with neither shows "-"."""
    for seed, (after, shortest) in enumerate([(0.26, 250.0), (0.30, 30.0), (0.19, 120.0)], start=1):
        write_seed(tmp_path, f"0.5b_a_seed{seed}", (0.20, after), (300.0, shortest))
        write_seed(tmp_path, f"0.5b_c_seed{seed}", (0.20, after), (300.0, shortest))
    for seed, after in enumerate([0.61, 0.59], start=1):
        write_seed(tmp_path, f"1.5b_b_seed{seed}", (0.40, after), (280.0, 260.0), answer_first=0.25)
    for variant, model in [("a", "0.5b"), ("b", "1.5b"), ("c", "0.5b")]:
        make_record(tmp_path, variant, model, tmp_path / f"{variant}.json")
    record_a = json.loads((tmp_path / "a.json").read_text())
    record_a["per_template"] = {"answer_first": {f"0.5b_a_seed{seed}": {"0": 0.0, "2": share}
                                                 for seed, share in enumerate([0.5, 0.0, 1.0], start=1)}}
    (tmp_path / "a.json").write_text(json.dumps(record_a))
    result = subprocess.run([sys.executable, str(RECIPE / "variants_table.py"),
                             *(str(tmp_path / f"{variant}.json") for variant in "abc")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[2:5] == [
        "| `a` | 0.5b | 20.0 ± 0.0 | 25.0 ± 5.6 | +6.0, +10.0, -1.0 | 2 of 3 | 1 | 30.0 | 50, 0, 100 |",
        "| `b` | 1.5b | 40.0 ± 0.0 | 60.0 ± 1.4 | +21.0, +19.0 | 1 of 2 | 0 | 260.0 | 25, 25 |",
        "| `c` | 0.5b | 20.0 ± 0.0 | 25.0 ± 5.6 | +6.0, +10.0, -1.0 | 2 of 3 | 1 | 30.0 | - |",
    ]


def test_records_validated_at_other_steps_are_refused(tmp_path):
    variants_table = load("variants_table")
    for variant in "ab":
        write_seed(tmp_path, f"0.5b_{variant}_seed1", (0.2, 0.3), (300.0, 290.0))
        make_record(tmp_path, variant, "0.5b", tmp_path / f"{variant}.json")
    records = [json.loads((tmp_path / f"{v}.json").read_text()) for v in "ab"]
    records[1]["table_mean_sd"]["eval/held_out/solved"]["4"] = records[1]["table_mean_sd"]["eval/held_out/solved"]["2"]
    with pytest.raises(SystemExit, match=r"validated at different steps; expected \['0', '2'\]"):
        variants_table.table(records)


def test_the_default_is_read_off_in_the_fixed_order(tmp_path):
    """By hand, 0.5B records of 3 seeds (start 0.20; each seed (step 2 solved, step 1 solved) gives its gain and its
    lowest point against the start, step 1 being a validation here):
    - `steady`: gains +6, +6, +1, never below start: 0 below, 0 dipped, 2 at +5, mean +4.33;
    - `dips`: +10, +10, +10, but one seed fell to 0.09 at step 1 (-11 points, past DIP_POINTS): 1 dipped;
    - `lucky`: +20, +20, -0.5: one below its start, so last however high its mean;
    - `edge`: +6, +6, +1 and a seed at 0.11 at step 1 (-9 points, not a dip): ties `steady` on all four keys
      (mean +4.33 both), so the order falls to the name (`edge` before `steady`);
    - `more`: +6, +6, +6: 3 at the target, first. `vs_verl` and a 2-seed record are not ranked, a 1.5B one not
      listed."""
    variants_table = load("variants_table")
    plans = {"steady": [(0.26, 0.21), (0.26, 0.20), (0.21, 0.20)],
             "dips": [(0.30, 0.09), (0.30, 0.20), (0.30, 0.20)],
             "lucky": [(0.40, 0.20), (0.40, 0.20), (0.195, 0.20)],
             "edge": [(0.26, 0.11), (0.26, 0.20), (0.21, 0.20)],
             "more": [(0.26, 0.20), (0.26, 0.20), (0.26, 0.20)],
             "vs_verl": [(0.30, 0.20)] * 3, "few": [(0.30, 0.20)] * 2}
    records = []
    for variant, seeds in plans.items():
        for seed, (last, middle) in enumerate(seeds, start=1):
            lines = [{"step": 0, "eval/held_out/solved": 0.20},
                     {"step": 1, "timing_s/step": 9.0, "response_length/mean": 300.0, "eval/held_out/solved": middle},
                     {"step": 2, "timing_s/step": 9.0, "response_length/mean": 290.0, "eval/held_out/solved": last}]
            write_run(tmp_path, f"0.5b_{variant}_seed{seed}", lines, {"wall_s": 30.0})
        make_record(tmp_path, variant, "0.5b", tmp_path / f"{variant}.json")
        records.append(json.loads((tmp_path / f"{variant}.json").read_text()))
    write_seed(tmp_path, "1.5b_big_seed1", (0.40, 0.70), (280.0, 260.0))
    make_record(tmp_path, "big", "1.5b", tmp_path / "big.json")
    records.append(json.loads((tmp_path / "big.json").read_text()))
    lines = variants_table.ranking(records).splitlines()
    assert [line.split("`")[1] for line in lines[1:6]] == ["more", "edge", "steady", "dips", "lucky"]
    assert lines[1] == "1. `more`: 0 below start, 0 fell 10+ points, 3 of 3 at the target, mean gain +6.0"
    assert lines[4] == "4. `dips`: 0 below start, 1 fell 10+ points, 3 of 3 at the target, mean gain +10.0"
    assert lines[5] == "5. `lucky`: 1 below start, 0 fell 10+ points, 2 of 3 at the target, mean gain +13.2"
    assert lines[6:] == ["Not ranked: `vs_verl`, current's scoring at verl's settings, a measurement, not a default",
                         "Not ranked: `few`, 2 of 3 seeds"]
    assert "big" not in "\n".join(lines)


def test_two_records_of_one_variant_are_refused_naming_both(tmp_path):
    """Seeds 1-2's record left beside the 3-seed one it became would be a second row and a second ranked entry."""
    write_seed(tmp_path, "0.5b_a_seed1", (0.2, 0.3), (300.0, 290.0))
    make_record(tmp_path, "a", "0.5b", tmp_path / "a_seeds1.json")
    make_record(tmp_path, "a", "0.5b", tmp_path / "a_all.json")
    result = subprocess.run([sys.executable, str(RECIPE / "variants_table.py"), str(tmp_path / "a_seeds1.json"),
                             str(tmp_path / "a_all.json")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert f"{tmp_path / 'a_seeds1.json'} and {tmp_path / 'a_all.json'}: two records of `a` at 0.5b" in result.stderr
