"""host_seeds.sh, the recipe's seeds on the offline GPU host, run here for real with a `python` first on PATH that
records main_ppo's arguments instead of training: a queue of variants and seeds starts detached in one call and runs
in order, a variant that fails does not stop the next, pack copies each seed's logs back, and a bad queue is refused
before anything starts."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HOST_SEEDS = REPO / "recipes" / "qwen25_coder_gsm_symbolic" / "host_seeds.sh"


@pytest.fixture
def host(tmp_path):
    """The host's folders, and an environment whose `python` and `python3` stand in for the trainer: main_ppo's
    arguments go a line a call to argv.txt, with one validation file where the trainer would write it; verl_compare.py
    runs with this interpreter; anything else (the data and model preparation, the versions line) does nothing."""
    fake = tmp_path / "bin"
    fake.mkdir()
    script = ("#!/usr/bin/env bash\n"
              f'case "$1" in */verl_compare.py) exec {sys.executable} "$@" ;; esac\n'
              '[ "$1 $2" = "-m hybridrl.main_ppo" ] || exit 0\n'
              'echo "${*:3}" >> "$ARGV_OUT"\n'
              'for a in "$@"; do case "$a" in trainer.validation_data_dir=*)\n'
              '    mkdir -p "${a#*=}" && echo \'{"step": 0}\' > "${a#*=}/0.jsonl" ;; esac; done\n')
    for name in ("python", "python3"):
        (fake / name).write_text(script)
        (fake / name).chmod(0o755)
    pieces = tmp_path / "pieces"
    pieces.mkdir()
    (pieces / "manifest.json").write_text("{}")
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "ARGV_OUT": str(tmp_path / "argv.txt"),
           "OUT": str(tmp_path / "out"), "PIECES": str(pieces), "HOST_WORK_DIR": str(tmp_path / "work"),
           "HOST_COPY_DIR": str(tmp_path / "copy"), "DETACHED_ROOT": str(tmp_path / "detached")}
    return tmp_path, env


def host_seeds(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(HOST_SEEDS), *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)


def test_a_queue_runs_its_variants_in_order_past_a_failed_one_and_pack_copies_each_seed(host):
    tmp, env = host
    started = host_seeds(env, "start", "current", "1", "2", "verl", "1", "dr_grpo", "3")
    assert started.returncode == 0, started.stdout + started.stderr
    name = "current+verl+dr_grpo"
    assert f"queue: {name} (pack it with: host_seeds.sh pack {name} SECONDS)" in started.stdout
    assert (tmp / "copy" / "recipes" / "qwen25_coder_gsm_symbolic" / "compare.sh").exists()  # it runs from a copy

    packed = host_seeds(env, "pack", "current+verl+dr_grpo", "240")
    assert packed.returncode == 0, packed.stdout + packed.stderr
    assert "current+verl+dr_grpo ended with status 1" in packed.stdout  # verl failed (no data, no verl site here)
    log = (tmp / "out" / "current_verl_dr_grpo.log").read_text()  # no '+': the device tool refuses it
    marks = ["== queue: current seeds 1 2", "== current, MODEL=0.5b, SEED=1", "== current, MODEL=0.5b, SEED=2",
             "== queue: verl seeds 1", "missing: ", "== queue: verl failed", "== queue: dr_grpo seeds 3",
             "== dr_grpo, MODEL=0.5b, SEED=3"]
    at = [log.index(mark) for mark in marks]
    assert at == sorted(at), log
    # each seed's whole time and clock, which a lease is planned by (the fake trainer takes well under a minute)
    timed = re.findall(r"^== (\w+) seed (\d): (\d+) s in all, ended \d\d:\d\d:\d\d UTC$", log, re.M)
    assert [(variant, seed) for variant, seed, _ in timed] == [("current", "1"), ("current", "2"), ("dr_grpo", "3")]
    assert all(int(seconds) < 60 for _, _, seconds in timed), timed
    # the seeds' arguments, in order: run.sh's with each seed, the variant's override for dr_grpo alone
    calls = (tmp / "argv.txt").read_text().splitlines()
    assert [re.search(r"\btrainer\.seed=(\S+)", call).group(1) for call in calls] == ["1", "2", "3"]
    assert ["algorithm.norm_adv_by_std_in_grpo=false" in call for call in calls] == [False, False, True]
    assert f"trainer.default_local_dir={tmp}/work/compare/0.5b_dr_grpo_seed3" in calls[2]
    assert sorted(path.name for path in (tmp / "out").glob("*.tgz")) == [
        "0.5b_current_seed1.tgz", "0.5b_current_seed2.tgz", "0.5b_dr_grpo_seed3.tgz"]


@pytest.mark.parametrize("args, error", [
    (["curent", "1"], "VARIANT=curent: expected current, dr_grpo"),
    (["1", "current"], "start: a seed (1) before any VARIANT"),
    (["current"], "start: give VARIANT SEED... (got: current)"),
    (["current", "dr_grpo", "1"], "start: give current its seeds"),
])
def test_a_bad_queue_is_refused_before_anything_starts(host, args, error):
    tmp, env = host
    refused = host_seeds(env, "start", *args)
    assert refused.returncode == 2 and error in refused.stderr, refused.stderr
    assert not (tmp / "detached").exists() and not (tmp / "copy").exists() and not (tmp / "out" / "host.txt").exists()
