"""verl's own CPU unit tests pass here, ported by import lines only (issue 57, item 3).

Each case takes one of verl's test files from a released wheel (tests/verl_release.py: pinned SHA-256, cached outside
the repository), ports it (`verl.` -> `hybridrl.compat.verl.` in its import lines, nothing else), writes it into a
temporary folder and runs it with pytest in a subprocess. Every test it collects must pass; a test it skips must be
named in EXPECTED_SKIPS with its reason. The newest release comes first; an older release is a case of its own where
its file differs (a release whose file equals a newer one's is covered by that one).

A verl test that reports a failed check by returning False instead of asserting (test_rollout_corr.py's
test_metrics_completeness does) fails here: RETURN_FALSE_FAILS, written beside the ported file as its conftest.py,
asserts on every test's return value.
"""
from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest

from verl_release import port, verl_release

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (release, file in verl's tests/): for each file, every distinct version of it among verl's 2026 releases, named by
# the newest release that ships it. Not here: 0.7.0's test_rollout_corr.py, written for the API verl replaced in 0.7.1
# (rollout_rs "token"/"sequence"/"geometric" with rollout_rs_threshold_lower, the token veto), which verl's current
# helper refuses too.
CASES = [
    ("0.9.1", "trainer/ppo/test_core_algos_on_cpu.py"),  # = 0.8.0, 0.9.0
    ("0.7.1", "trainer/ppo/test_core_algos_on_cpu.py"),  # = 0.7.0
    ("0.9.1", "trainer/ppo/test_rollout_corr.py"),  # = 0.9.0
    ("0.8.0", "trainer/ppo/test_rollout_corr.py"),
    ("0.7.1", "trainer/ppo/test_rollout_corr.py"),
    ("0.9.1", "trainer/ppo/test_value_loss_normalization_on_cpu.py"),  # = 0.9.0; new in 0.9.0
    ("0.9.1", "test_protocol_on_cpu.py"),
    ("0.9.0", "test_protocol_on_cpu.py"),  # = 0.7.0, 0.7.1, 0.8.0
]

RETURN_FALSE_FAILS = """
import functools


def pytest_collection_modifyitems(items):
    for item in items:
        item.obj = must_not_return_false(item.obj)


def must_not_return_false(test):
    @functools.wraps(test)
    def checked(*args, **kwargs):
        assert test(*args, **kwargs) is not False, f"{test.__name__} returned False: one of its checks failed"
    return checked
"""

# "file::test" -> why it may skip here. Empty: every test of every case runs.
EXPECTED_SKIPS: dict[str, str] = {}


def run_test_file(text: str, file_name: str, folder) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run one test file's text with pytest in `folder`; returns the run and one record per test case from pytest's
    JUnit XML."""
    ported = folder / file_name
    ported.write_text(text)
    (folder / "conftest.py").write_text(RETURN_FALSE_FAILS)
    report = folder / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", f"--junitxml={report}",
         ported.name],
        cwd=folder, env=env, capture_output=True, text=True, timeout=240)
    return run, junit_cases(report) if report.is_file() else []


def junit_cases(report) -> list[dict]:
    """Each test case's name and outcome (passed, failed, error, skipped) with the message pytest gave."""
    cases = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = child.get("message", "")
        cases.append({"name": case.get("name"), "outcome": outcome, "message": message})
    return cases


@pytest.mark.parametrize("release, relative_path", CASES, ids=[f"{release}/{path}" for release, path in CASES])
def test_verls_unit_tests_pass_ported_by_import_lines(release, relative_path, tmp_path):
    source = verl_release(release) / "tests" / relative_path
    run, cases = run_test_file(port(source.read_text()), os.path.basename(relative_path), tmp_path)
    output = run.stdout[-6000:] + run.stderr[-2000:]
    assert cases, f"verl {release} tests/{relative_path}: pytest reported no test case (exit {run.returncode}):\n" + output
    file_name = os.path.basename(relative_path)
    not_passed = {case["name"]: f'{case["outcome"]}: {case["message"]}' for case in cases
                  if case["outcome"] != "passed"
                  and not (case["outcome"] == "skipped" and f'{file_name}::{case["name"]}' in EXPECTED_SKIPS)}
    assert not not_passed, (f"verl {release} tests/{relative_path}: {len(not_passed)} of {len(cases)} tests did not "
                            f"pass: {not_passed}\n{output}")
    assert run.returncode == 0, output


def test_the_harness_reads_each_outcome_and_fails_a_test_that_returns_false(tmp_path):
    text = """
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_returns_false():
    return False

def test_returns_true():
    return True

def test_fails():
    assert 1 + 1 == 3

@pytest.mark.skip(reason="no GPU")
def test_skips():
    pass
"""
    run, cases = run_test_file(text, "test_sample.py", tmp_path)
    outcomes = {case["name"]: case["outcome"] for case in cases}
    assert outcomes == {"test_passes": "passed", "test_returns_false": "failed", "test_returns_true": "passed",
                        "test_fails": "failed", "test_skips": "skipped"}
    assert "returned False" in next(case["message"] for case in cases if case["name"] == "test_returns_false")
    assert run.returncode == 1
