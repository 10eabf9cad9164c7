"""GPU tests' own rule: a test marked `own_process(*engines)` runs in a pytest process of its own when its `engine`
param is one of `engines`.

vLLM allows one in-process engine per process (its CuMem allocator asserts "can only be used for one instance per
process"), and the rollout runs vLLM's engine core in the worker's process, as the trainer does. So two tests that
each start a vLLM engine cannot share a pytest process: on the H200, 2026-12-02, test_engine_worker.py's LoRA test
failed that way after its rollout_mode test, when the file ran as one command. The marked test's body then runs in
a child `python -m pytest <its node id>` (same interpreter and environment, from the root folder, its output shown as it
goes), and the parent passes or fails with the child's exit code.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD_ENV = "HYBRIDRL_GPU_TEST_CHILD"  # set in the child: it runs the body itself


def pytest_configure(config):
    config.addinivalue_line("markers", "own_process(*engines): run the test in its own pytest process when its "
                                       "`engine` param is one of these (tests/gpu/conftest.py)")


def needs_own_process(item) -> bool:
    marker = item.get_closest_marker("own_process")
    if marker is None or os.environ.get(CHILD_ENV):
        return False
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("engine") in marker.args


def child_command(nodeid: str) -> list[str]:
    """The child pytest for one node id: no xdist, no cache, output shown; the parent's timeout plugin covers it."""
    return [sys.executable, "-m", "pytest", nodeid, "-o", "addopts=-ra", "-p", "no:xdist", "-p", "no:cacheprovider",
            "-q", "-s", "--timeout", "0"]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Run a marked test's body in a child pytest process instead of this one (its fixtures were set up here; the
    engine tests' are a name and a temp folder)."""
    if not needs_own_process(pyfuncitem):
        return None
    child = subprocess.run(child_command(pyfuncitem.nodeid), env={**os.environ, CHILD_ENV: "1"},
                           cwd=pyfuncitem.config.rootpath)
    if child.returncode == 5:  # pytest's "no tests ran": the node id did not select the test
        pytest.fail(f"the child pytest selected nothing for {pyfuncitem.nodeid}")
    assert child.returncode == 0, f"{pyfuncitem.nodeid} failed in its own pytest process (exit {child.returncode}); " \
                                  f"its output is above"
    return True
