"""The test suite's own isolation: a test that hangs fails alone, with its stack, and what it did to the module's Ray
does not stall the tests after it (conftest.py: pyproject's per-test timeout, and `ray_that_answers`)."""
import os
import shutil
import subprocess
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# A module whose first test waits forever on an actor that never answers (pytest-timeout's signal alone cannot
# interrupt that wait: the run would hang), and whose second needs a Ray that runs tasks.
STALLING_MODULE = '''
import time

import pytest
import ray


@ray.remote(num_cpus=4)  # every CPU of the module's Ray
class NeverAnswers:
    def wait(self):
        while True:
            time.sleep(1)


@pytest.mark.timeout(5)  # it only waits: nothing in it has to finish in time
def test_waits_forever_on_ray(ray_local):
    actor = NeverAnswers.remote()
    ray.get(actor.wait.remote())


def test_after_it_gets_a_ray_that_answers(ray_local):
    assert ray.get(ray.remote(lambda: 6 * 7).remote()) == 42
'''


def test_a_hung_test_fails_alone_with_its_stack_and_the_next_gets_a_working_ray(tmp_path):
    shutil.copy(os.path.join(TESTS_DIR, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_stalling.py").write_text(STALLING_MODULE)
    # 60 s for a test's body (the hung one says 5 s itself); Ray's start (set-up) not counted. On an xdist worker, as the default tier runs. This
    # run's own pytest options stay out of it.
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}
    env["PYTHONPATH"] = REPO_ROOT
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1",
                             "-o", "timeout=60", "-o", "timeout_func_only=true", "-rA", str(tmp_path)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    out = result.stdout
    assert "FAILED test_stalling.py::test_waits_forever_on_ray" in out, out[-4000:]
    assert 'test_stalling.py", line 18 in test_waits_forever_on_ray' in out  # the hung line's stack
    assert "PASSED test_stalling.py::test_after_it_gets_a_ray_that_answers" in out, out[-4000:]
    assert "conftest: test_stalling.py::test_waits_forever_on_ray passed its timeout waiting on Ray" in out
    assert "conftest: the module's Ray was shut down; starting it again" in out
    assert result.returncode == 1
