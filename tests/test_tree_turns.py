"""benchmarks/tree_turns.py: a script run from two trees in turns, A B B A, summarised as ratios of times."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.tree_turns import summarise

# Each tree's stand-in for ppo_step.py writes a record of ppo_step's shape: its tree's step seconds, and which tree ran.
SCRIPT = """import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
seconds = {SECONDS}
json.dump({{"results": {{"rmpad32k": {{"steps/timing_s/step": seconds, "cwd": os.getcwd()}}}}}}, open(out, "w"))
"""


def test_summarise_pools_each_side_s_steps_and_divides_medians_and_totals():
    turns = [{"side": "before", "steps": {"step": [2.0, 4.0]}}, {"side": "after", "steps": {"step": [3.0, 3.0]}},
             {"side": "after", "steps": {"step": [1.0]}}, {"side": "before", "steps": {"step": [6.0]}}]
    ratio = summarise(turns)["ratios"]["step"]
    # before 2, 4, 6: median 4, mean 4; after 3, 3, 1: median 3, mean 7/3
    assert ratio["after_over_before_median"] == pytest.approx(3 / 4)
    assert ratio["after_over_before_total"] == pytest.approx((7 / 3) / 4)
    assert ratio["steps"] == [3, 3]


def test_the_turns_run_each_tree_s_own_script_in_order(tmp_path):
    for tree, seconds in (("before", [2.0, 2.0]), ("after", [1.0, 1.5])):
        (tmp_path / tree / "benchmarks").mkdir(parents=True)
        (tmp_path / tree / "benchmarks" / "bench.py").write_text(SCRIPT.format(SECONDS=seconds))
    out = tmp_path / "out"
    subprocess.run([sys.executable, "benchmarks/tree_turns.py", "--before", str(tmp_path / "before"), "--after",
                    str(tmp_path / "after"), "--out", str(out), "--", "benchmarks/bench.py", "--x", "1"], check=True)
    record = json.loads((out / "tree_turns.json").read_text())
    assert [turn["side"] for turn in record["turns"]] == ["before", "after", "after", "before"]
    assert [turn["exit"] for turn in record["turns"]] == [0, 0, 0, 0]
    assert json.loads((out / "after2.json").read_text())["results"]["rmpad32k"]["cwd"] == str(tmp_path / "after")
    assert record["ratios"]["step"]["after_over_before_median"] == pytest.approx(1.25 / 2.0)
