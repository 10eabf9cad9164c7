"""hybridrl/utils/logging.py: what the hybridrl loggers print in a fresh process (a driver or a Ray worker), where no
handler is set up. A subprocess, because pytest's own handlers on the root logger change what is printed."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG_TWO = ("import logging, hybridrl.workers.rollout.engine_load as e; "
           "e.logger.info('graphs up to %d', 512); e.logger.debug('per switch')")


def run(level: str | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "HYBRIDRL_LOGGING_LEVEL"}
    env["PYTHONPATH"] = REPO
    if level is not None:
        env["HYBRIDRL_LOGGING_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", LOG_TWO], env=env, capture_output=True, text=True, timeout=120)


def test_info_is_printed_by_default_and_debug_is_not():
    result = run(None)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["hybridrl.workers.rollout.engine_load: graphs up to 512"]


def test_the_level_comes_from_the_environment():
    assert run("warning").stderr == ""
    assert run("DEBUG").stderr.splitlines() == ["hybridrl.workers.rollout.engine_load: graphs up to 512",
                                                "hybridrl.workers.rollout.engine_load: per switch"]


def test_a_level_that_does_not_exist_is_named():
    result = run("LOUD")
    assert result.returncode != 0
    assert "HYBRIDRL_LOGGING_LEVEL='LOUD': expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in result.stderr
