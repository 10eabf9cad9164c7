"""The run dashboard (hybridrl/dashboard), read from files the trainer's own writers make and shown in a real browser.

The reading side is tested on its own first (metrics.jsonl read as it grows, a resumed run's replaced steps, dumps
found in a moved run directory, configs compared). The page is then started as a user starts it,
`python -m hybridrl.dashboard RUN_DIR RUN_DIR --port 0`, and loaded in headless Chromium (Debian's `chromium`,
which .ci/run installs; playwright drives it and downloads no browser): the assertions are on the rendered page.
Each view's screenshot is kept under the test's tmp dir (`screenshots/`, printed). The default tier shows it on
runs written by Tracking and dump_generations with hand-chosen numbers; the slow tier on the embedded default's run.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from hybridrl.dashboard.run_files import MetricsLog, RunDir, RunDirError, compare_configs
from hybridrl.dashboard.server import Dashboard, NotFound
from hybridrl.trainer.ppo.generation_dump import dump_generations
from hybridrl.trainer.tracking import Tracking

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIEWS = ("curves", "time", "rollouts", "validation", "runs")
PAGE_WAIT_MS = 60_000  # generous: the page polls every 1.5 s, on a loaded 2-core machine


# ---------------------------------------------------------------- reading a run directory

def write_lines(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_metrics_are_read_as_they_grow_and_a_resumed_run_replaces_its_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, '{"step": 1, "a": 0.5}\n{"step": 2, "a": 0.25, "b": NaN}\n{"step": 3, "a"')
    log = MetricsLog(str(path))
    log.refresh()
    # the unfinished third line waits; b is new at step 2 (a gap at step 1); NaN is a gap, JSON has none
    assert log.series(["a", "b"], 0) == {"steps": [1, 2], "values": {"a": [0.5, 0.25], "b": [None, None]},
                                         "rows": 2, "revision": 0}
    write_lines(path, ': 0.125}\n{"step": 2, "a": 1.0}\n')  # the line completes; a resume from step 1 logs 2 again
    log.refresh()
    assert log.series(["a"], 0) == {"steps": [1, 2], "values": {"a": [0.5, 1.0]}, "rows": 2, "revision": 1}
    assert log.series(["a"], 1)["values"] == {"a": [1.0]}
    with pytest.raises(KeyError, match="has no metric \\['c'\\]"):
        log.series(["a", "c"], 0)
    write_lines(path, '{"a": 1}\n')
    with pytest.raises(RunDirError, match="expected objects with an integer 'step'"):
        log.refresh()


def test_a_run_directory_is_checked_and_its_dumps_follow_it_when_moved(tmp_path):
    with pytest.raises(RunDirError, match="is not a directory"):
        RunDir(str(tmp_path / "missing"))
    with pytest.raises(RunDirError, match=r"expected metrics.jsonl in it .* it holds \[\]"):
        RunDir(str(tmp_path))
    cluster_dir = "/cluster/home/me/runs/grpo"  # where the run wrote; the files were copied here since
    Tracking("p", "e", ["jsonl"], config={"trainer": {
        "default_local_dir": cluster_dir, "rollout_data_dir": f"{cluster_dir}/rollouts",
        "validation_data_dir": None}}, local_dir=str(tmp_path)).finish()
    dump_generations(str(tmp_path / "rollouts"), 4, [{"input": "1+1=", "output": "2", "score": 1.0}])
    os.mkdir(tmp_path / "global_step_4")
    run = RunDir(str(tmp_path))
    assert run.dump_dir("rollout_data_dir") == str(tmp_path / "rollouts")
    assert run.dump("rollout_data_dir", 4) == [{"input": "1+1=", "output": "2", "score": 1.0, "step": 4}]
    assert run.checkpoints() == [4]
    with pytest.raises(KeyError, match=r"no dump of step 5; dumped steps: \[4\]"):
        run.dump("rollout_data_dir", 5)
    with pytest.raises(KeyError, match="trainer.validation_data_dir was not set in this run"):
        run.dump("validation_data_dir", 4)
    with pytest.raises(NotFound, match=r"run=1: expected 0..0"):
        Dashboard([run]).answer("/api/rollouts", {"run": ["1"], "step": ["4"]})


def test_the_dashboard_names_the_dump_size_marker_as_the_trainer_writes_it():
    from hybridrl.dashboard import run_files
    from hybridrl.trainer.ppo import generation_dump

    assert run_files.SIZE_LIMIT_FILE == generation_dump.SIZE_LIMIT_FILE


def test_configs_are_compared_key_by_key():
    compared = compare_configs([{"a": {"lr": 1e-4, "n": 2}, "b": [1]}, {"a": {"lr": 2e-5, "n": 2}, "b": [1]}, None])
    assert compared == {"keys": ["a.lr", "a.n", "b"], "differ": ["a.lr"],
                        "values": [{"a.lr": 1e-4, "a.n": 2, "b": [1]}, {"a.lr": 2e-5, "a.n": 2, "b": [1]}, None]}


def test_a_bad_run_directory_stops_the_command_before_it_serves(tmp_path):
    result = subprocess.run([sys.executable, "-m", "hybridrl.dashboard", str(tmp_path), "--port", "0"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"dashboard error: {tmp_path}: expected metrics.jsonl in it (written by " \
                            f"trainer.logger=[console,jsonl]); it holds []\n"


# ---------------------------------------------------------------- the page in a browser

class DashboardProcess:
    """`python -m hybridrl.dashboard RUN_DIR... --port 0` in a subprocess; `url` once it listens."""

    def __init__(self, run_dirs):
        env = {**os.environ, "PYTHONPATH": REPO_ROOT}
        self.process = subprocess.Popen([sys.executable, "-m", "hybridrl.dashboard", *map(str, run_dirs),
                                         "--port", "0"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True)
        first_line = self.process.stdout.readline()
        assert first_line.startswith("dashboard: http://127.0.0.1:"), first_line
        self.url = first_line.split()[1]

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture
def page():
    """A headless Chromium page (Debian's chromium; playwright drives it and fetches no browser of its own)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    assert chromium, "the dashboard test needs Debian's chromium: apt-get install -y chromium (.ci/run does)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(PAGE_WAIT_MS)
        errors = []
        page.on("pageerror", lambda error: errors.append(error))
        yield page
        browser.close()
        assert not errors, f"the page raised: {errors}"


def screenshot(page, directory, view: str) -> None:
    directory.mkdir(exist_ok=True)
    page.screenshot(path=str(directory / f"{view}.png"))


def number_cell(value: float) -> str:
    """How the page writes a number: rounded to 4 decimals, no trailing zeros."""
    return format(round(value, 4), "g")


def table_cells(page, table: str) -> list[list[str]]:
    return page.eval_on_selector_all(f"{table} tbody tr",
                                     "rows => rows.map(row => [...row.cells].map(cell => cell.textContent))")


def check_curves(page, metric: str, points: list[int]) -> None:
    """The metric's chart is drawn with `points` steps for each run, in the run order of the command line."""
    chart = f'.chart[data-metric="{metric}"]'
    expected = json.dumps(points, separators=(",", ":"))  # as the page's JSON.stringify writes it
    page.wait_for_function(f"document.querySelector('{chart}')?.dataset.points === '{expected}'")
    drawn = sum(count > 0 for count in points)  # one curve a run with points, drawn in SVG
    assert page.locator(f"{chart} .scatterlayer .trace").count() == drawn


def check_rollout_row(page, run_index: int, step: int, response: str, score: float) -> None:
    """The rollouts view of `step` has a row with that response text and that score."""
    page.select_option("#rollout-run", str(run_index))
    page.wait_for_function(f"[...document.querySelectorAll('#rollout-step option')].some(o => o.value === '{step}')")
    page.select_option("#rollout-step", str(step))
    row = page.locator("#rollout-table tbody tr").filter(
        has=page.locator('td[data-column="output"]', has_text=response)).first
    row.wait_for()
    assert row.locator('td[data-column="output"]').inner_text() == response
    assert row.locator('td[data-column="score"]').inner_text() == number_cell(score)


def show_every_view(page, url, shots) -> None:
    for view in VIEWS:
        page.goto(f"{url}#{view}")
        page.wait_for_function("Number(document.body.dataset.polls) >= 1")
        screenshot(page, shots, view)


# The hand-made runs: step -> metrics; what the trainer logs, with numbers chosen here.
def step_metrics(step: int, lr_scale: float) -> dict:
    return {"critic/score/mean": 0.25 * step * lr_scale, "actor/pg_loss": -0.1 * step,
            "timing_s/gen": 0.5, "timing_s/update_actor": 1.5, "timing_s/step": 2.5, "perf/throughput": 1000.0 + step}


def write_run(run_dir, lr: float, steps: int, finished: bool, dump_max_mb: float | None = None) -> Tracking:
    """A run directory as the trainer leaves it, written with its own writers; returns the still-open Tracking."""
    config = {"trainer": {"default_local_dir": str(run_dir), "rollout_data_dir": str(run_dir / "rollouts"),
                          "validation_data_dir": None, "total_training_steps": 3},
              "actor_rollout_ref": {"actor": {"optim": {"lr": lr}}}}
    tracking = Tracking("p", run_dir.name, ["jsonl"], config=config, local_dir=str(run_dir))
    tracking.log({"val-core/task/reward/mean@1": 0.0}, step=0)
    tracking.log_generations([("2+2=", "4", 1.0), ("3+1=", "5", 0.0)], step=0)
    for step in range(1, steps + 1):
        tracking.log(step_metrics(step, lr / 1e-4), step=step)
        dump_generations(str(run_dir / "rollouts"), step,
                         [{"input": f"1+{step}=", "output": f"<answer>{step + 1}</answer>", "score": 1.0,
                           "reward": 1.0, "advantage": 0.5, "response_tokens": 5},
                          {"input": f"1+{step}=", "output": "The answer is calc", "score": 0.0, "reward": 0.0,
                           "advantage": -0.5, "response_tokens": 4,
                           "turns": [{"by": "policy", "text": "The answer is "}, {"by": "tool", "text": "calc"}]}],
                         max_mb=dump_max_mb)
    tracking.log_generations([("2+2=", "<answer>4</answer>", 1.0)], step=steps)
    if finished:
        tracking.finish()
        with open(run_dir / "summary.json", "w") as f:
            json.dump({"val_score_metric": None, "val_score_before": 0.0, "val_score_after": 0.5, "steps": steps,
                       "wall_s": 12.5, "checkpoint_dir": None, "stopped_early": False,
                       "reward_errors": {"train": 0, "val": 0}}, f)
    return tracking


def test_the_page_shows_finished_and_running_runs_and_the_new_step_without_a_reload(tmp_path, page):
    finished_dir, running_dir, shots = tmp_path / "finished", tmp_path / "running", tmp_path / "screenshots"
    write_run(finished_dir, lr=1e-4, steps=3, finished=True, dump_max_mb=500 / 2 ** 20)  # room for 2 steps (348 bytes each)
    running = write_run(running_dir, lr=2e-5, steps=2, finished=False)
    server = DashboardProcess([finished_dir, running_dir])
    try:
        show_every_view(page, server.url, shots)
        page.goto(f"{server.url}#curves")
        check_curves(page, "critic/score/mean", [3, 2])
        groups = page.eval_on_selector_all("details.group", "els => els.map(e => e.dataset.group)")
        assert groups == ["critic", "actor", "val-*", "timing_s", "perf"]
        page.fill("#search", "pg_loss")
        assert page.inner_text("#metric-count") == "1 of 7 metrics"
        page.fill("#search", "")

        page.goto(f"{server.url}#rollouts")
        check_rollout_row(page, 0, 2, "<answer>3</answer>", 1.0)
        assert page.locator("#rollout-step option").all_inner_texts() == ["1", "2"]
        assert page.inner_text("#rollout-note") == \
            f"steps from 3 on were not dumped: the dumps reached trainer.rollout_data_max_mb={500 / 2 ** 20}"
        page.click('#rollout-table th[data-key="score"]')  # sorted by score, ascending now
        assert page.locator('#rollout-table tbody td[data-column="score"]').all_inner_texts() == ["0", "1"]
        page.click('#rollout-table th[data-key="advantage"]')  # the update's columns sort too: advantage, descending
        assert page.locator('#rollout-table tbody td[data-column="advantage"]').all_inner_texts() == ["0.5", "-0.5"]
        assert page.locator("#rollout-table pre.tool").all_inner_texts() == ["calc"]  # the tool's piece, set apart

        page.goto(f"{server.url}#validation")
        page.select_option("#val-question", "2+2=")
        assert table_cells(page, "#val-table") == [["0", "4", "1"], ["3", "<answer>4</answer>", "1"]]

        page.goto(f"{server.url}#time")
        page.wait_for_function("document.getElementById('time-chart').dataset.steps === '3'")
        assert page.locator("#time-chart .legendtext").all_text_contents() == ["other", "update actor", "generate"]
        bars = page.evaluate("Object.fromEntries(document.getElementById('time-chart').data.map(t => [t.name, t.y]))")
        assert bars == {"generate": [0.5] * 3, "update actor": [1.5] * 3, "other": [0.5] * 3}  # 2.5 - 0.5 - 1.5

        page.goto(f"{server.url}#runs")
        differs = page.locator("#config-table tr.differs td:first-child").all_inner_texts()
        assert differs == ["actor_rollout_ref.actor.optim.lr", "trainer.default_local_dir", "trainer.rollout_data_dir"]
        assert table_cells(page, '.card[data-run="0"]')[:2] == [["score before → after", "0.0000 → 0.5000 (mean of "
                                                                "val-core/*)"], ["stop", "finished: 3 steps"]]
        assert table_cells(page, '.card[data-run="1"]')[0] == ["status", "running (no summary.json yet), last step 2"]

        page.goto(f"{server.url}#curves")
        check_curves(page, "critic/score/mean", [3, 2])
        page.evaluate("window.loadedOnce = true")  # gone if the page reloads
        running.log(step_metrics(3, 0.2), step=3)  # the running run writes its next step
        check_curves(page, "critic/score/mean", [3, 3])
        assert page.evaluate("window.loadedOnce") is True
        ys = page.evaluate("document.querySelector('.chart[data-metric=\"critic/score/mean\"]').data[1].y")
        assert ys == pytest.approx([0.05, 0.1, 0.15])  # 0.25 * step * (2e-5 / 1e-4)
        screenshot(page, shots, "curves_after_new_step")
        print(f"dashboard screenshots: {shots}")
    finally:
        running.finish()
        server.stop()


# ---------------------------------------------------------------- the embedded default's runs

def default_run_command(run_dir, steps: int) -> list[str]:
    """`python -m hybridrl.main_ppo` on the embedded default, writing what the dashboard reads."""
    return [sys.executable, "-m", "hybridrl.main_ppo", f"trainer.default_local_dir={run_dir}",
            "trainer.logger=[console,jsonl]", f"trainer.rollout_data_dir={run_dir}/rollouts",
            f"trainer.validation_data_dir={run_dir}/val", f"trainer.total_training_steps={steps}"]


def wait_for_file(path, process: subprocess.Popen, timeout_s: float) -> None:
    for _ in range(int(timeout_s * 2)):
        if os.path.isfile(path):
            return
        assert process.poll() is None, f"the run ended (exit {process.returncode}) before writing {path}"
        time.sleep(0.5)
    raise AssertionError(f"no {path} after {timeout_s} s")


RUNNING_STEPS = 6  # long enough that the page is up before the run ends


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_page_shows_the_embedded_default_finished_and_while_it_runs(tmp_path, builtin_cache, page):
    finished_dir, running_dir, shots = tmp_path / "finished", tmp_path / "running", tmp_path / "screenshots"
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "HYBRIDRL_CACHE_DIR": builtin_cache}
    result = subprocess.run(default_run_command(finished_dir, steps=2), cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    finished = RunDir(str(finished_dir))
    assert finished.config()["trainer"]["total_training_steps"] == 2  # the trainer wrote its resolved config
    first_sample = finished.dump("rollout_data_dir", 2)[0]

    running = subprocess.Popen(default_run_command(running_dir, steps=RUNNING_STEPS), cwd=tmp_path, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = None
    try:
        wait_for_file(running_dir / "metrics.jsonl", running, timeout_s=600)
        server = DashboardProcess([finished_dir, running_dir])
        show_every_view(page, server.url, shots)
        page.goto(f"{server.url}#rollouts")
        check_rollout_row(page, 0, 2, first_sample["output"], first_sample["score"])
        page.goto(f"{server.url}#curves")
        chart = '.chart[data-metric="critic/score/mean"]'
        page.wait_for_function(f"document.querySelector('{chart}')?.dataset.points !== undefined")
        page.evaluate("window.loadedOnce = true")
        first_drawn = json.loads(page.get_attribute(chart, "data-points"))
        assert first_drawn[0] == 2 and first_drawn[1] < RUNNING_STEPS, first_drawn
        assert running.wait(timeout=600) == 0
        check_curves(page, "critic/score/mean", [2, RUNNING_STEPS])  # its later steps appeared as it wrote them
        assert page.evaluate("window.loadedOnce") is True
        page.goto(f"{server.url}#runs")
        page.wait_for_function("document.querySelector('.card[data-run=\"1\"]')?.textContent"
                               f".includes('finished: {RUNNING_STEPS} steps')")
        page.check("#only-differ")
        page.wait_for_function("document.querySelectorAll('#config-table tbody tr:not(.differs)').length === 0")
        differs = page.locator("#config-table tbody td:first-child").all_inner_texts()
        assert differs == ["trainer.default_local_dir", "trainer.rollout_data_dir", "trainer.total_training_steps",
                           "trainer.validation_data_dir"]
        screenshot(page, shots, "runs_after_the_run_ended")
        print(f"dashboard screenshots: {shots}")
    finally:
        running.kill()
        if server is not None:
            server.stop()
