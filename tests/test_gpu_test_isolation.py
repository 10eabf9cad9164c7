"""tests/gpu/conftest.py's own_process marker, on CPU: a marked test whose `engine` param is listed runs its body in a
child pytest process (another pid), the parent fails when the child does, and other params run in the parent.

Each case runs a real pytest on a small project written here, with a copy of that conftest.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

CONFTEST = os.path.join(os.path.dirname(__file__), "gpu", "conftest.py")

TESTS = '''
import os
import pytest

@pytest.fixture(params=["sglang", "vllm"])
def engine(request):
    return request.param

@pytest.mark.own_process("vllm")
def test_records_its_pid(engine, tmp_path_factory):
    with open(os.path.join(os.environ["PIDS_DIR"], engine), "w") as handle:
        handle.write(f"{os.getpid()} {os.environ.get('HYBRIDRL_GPU_TEST_CHILD', '')}")
    assert engine != os.environ.get("FAIL_ENGINE")
'''


def run_project(tmp_path, fail_engine: str = "") -> tuple[subprocess.CompletedProcess, dict[str, list[str]]]:
    project, pids = tmp_path / "project", tmp_path / "pids"
    project.mkdir()
    pids.mkdir()
    shutil.copy(CONFTEST, project / "conftest.py")
    (project / "test_marked.py").write_text(TESTS)
    (project / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PIDS_DIR": str(pids), "FAIL_ENGINE": fail_engine}
    env.pop("HYBRIDRL_GPU_TEST_CHILD", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                             "-o", "addopts=", "test_marked.py"], cwd=project, env=env, capture_output=True,
                            text=True, timeout=120)
    recorded = {name: (pids / name).read_text().split(" ") for name in os.listdir(pids)}
    return result, recorded


def test_the_listed_engine_runs_in_a_child_and_the_other_in_the_parent(tmp_path):
    result, recorded = run_project(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
    assert recorded["vllm"][1] == "1"  # the child's marker variable: the body ran there
    assert recorded["sglang"][1] == ""  # not marked for sglang: the body ran in the parent
    assert recorded["vllm"][0] != recorded["sglang"][0]


def test_a_failing_child_fails_the_parents_test(tmp_path):
    result, recorded = run_project(tmp_path, fail_engine="vllm")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 1 passed" in result.stdout
    assert "failed in its own pytest process (exit 1)" in result.stdout
    assert recorded["vllm"][1] == "1"
