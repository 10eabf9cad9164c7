"""The benchmarks' shared parts without a GPU: a trainer run streamed into its log, cut off at its time limit with its
whole process group and the steps it logged kept (benchmarks/trainer_run.py), and the heavy-tailed workload's
overrides, which hybridrl's config accepts for every asynchronous schedule (benchmarks/heavy_tail.py), and ppo_step.py's
runs named by layout and engine."""
import importlib.util
import json
import os
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.heavy_tail import heavy_tail_overrides  # noqa: E402
from benchmarks.trainer_run import Deadline, mean_metrics, run_trainer  # noqa: E402

# a stand-in trainer: logs two steps, starts a child that outlives it unless its group is killed, then sleeps
TRAINER = textwrap.dedent('''
    import json, subprocess, sys, time
    metrics, child_pid_file, sleep_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
    with open(metrics, "a") as f:
        for step in (1, 2):
            f.write(json.dumps({"training/global_step": step, "timing_s/step": 10.0 * step}) + "\\n")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(child_pid_file, "w").write(str(child.pid))
    print("trainer log line", flush=True)
    time.sleep(sleep_s)
    print("finished", flush=True)
''')


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie (killed, not yet reaped by init) is dead too
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _start(tmp_path, sleep_s: float, timeout: float | None):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    metrics, child_pid = tmp_path / "run" / "metrics.jsonl", tmp_path / "child.pid"
    metrics.parent.mkdir()
    metrics.write_text(json.dumps({"timing_s/step": 999.0}) + "\n")  # an earlier run's line: must not count
    run = run_trainer([sys.executable, str(script), str(metrics), str(child_pid), str(sleep_s)],
                      str(tmp_path / "trainer.log"), str(metrics), timeout=timeout)
    return run, int(child_pid.read_text())


def test_a_finished_run_keeps_its_log_and_only_its_own_steps(tmp_path):
    run, child = _start(tmp_path, sleep_s=0, timeout=None)
    assert run.code == 0 and run.error is None
    assert [step["timing_s/step"] for step in run.steps] == [10.0, 20.0]
    assert mean_metrics(run.steps)["timing_s/step"] == 15.0
    assert open(run.log_path).read().splitlines() == ["trainer log line", "finished"]
    os.kill(child, 9)


def test_a_run_past_its_limit_is_killed_with_its_children_and_keeps_its_steps(tmp_path):
    run, child = _start(tmp_path, sleep_s=300, timeout=5)
    assert run.code == "timeout"
    assert run.error == "exit timeout: trainer log line"
    assert [step["training/global_step"] for step in run.steps] == [1, 2]
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the trainer's child survived the kill of its process group"


def test_a_deadline_cuts_a_run_asking_for_more_to_what_is_left_of_it(tmp_path):
    """Two runs in one 10-minute command: the second's own limit must not reach past the command's."""
    assert Deadline(None).share(asked=60.0) == 60.0 and Deadline(None).left() is None
    assert Deadline(1000.0, margin=10.0).share(asked=60.0) == 60.0  # plenty left: the run's own limit holds
    plenty = Deadline(1000.0, margin=0.0)
    assert 249 < plenty.share(4) <= 250 and 199 < plenty.share(4, reserve=200) <= 200  # equal shares, less a reserve
    deadline = Deadline(4.0, margin=1.0)
    asked = deadline.share(asked=300.0)
    assert 0 < asked <= 3.0
    run, _ = _start(tmp_path, sleep_s=300, timeout=asked)  # its child dies with its process group
    assert run.code == "timeout" and run.wall_s < 60  # cut at the deadline, not after the 300 s it asked for
    assert [step["training/global_step"] for step in run.steps] == [1, 2]
    assert deadline.left() == 0.0 and deadline.share(asked=300.0) == 0.0  # nothing left for a next run


@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "fully_async"])
def test_heavy_tail_overrides_validate_under_every_schedule(tmp_path, schedule):
    import hybridrl.checks  # noqa: F401  registers the subsystems' config checks
    from hybridrl.config import compose_config, validate_config

    overrides = heavy_tail_overrides(str(tmp_path), tail_fraction=0.25, short_length=3, device="cpu")
    pools = [] if schedule == "sync" else ["actor_rollout_ref.hybrid_engine=false", "trainer.n_gpus_per_node=1",
                                           "rollout.n_gpus_per_node=1", f"async_training.mode={schedule}"]
    validate_config(compose_config(["trainer.device=cpu", *overrides, *pools]))

    spec = importlib.util.spec_from_file_location("heavy_tailed", tmp_path / "heavy_tailed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (module.TAIL_FRACTION, module.SHORT_LENGTH) == (0.25, 3)
    assert "data_flow.custom_generate_function.name=heavy_tailed_generate" in overrides


def test_partial_rollout_counts_whole_steps_per_trained_token_and_each_samples_staleness_by_hand():
    """partial_rollout.summarise on three hand-made steps, warm-up 1 (step s generates under version s - 1):
    - all steps: 6 s of steps for 8 + 14 + 8 trained tokens, 200 ms a token;
    - after the warm-up: steps 2-3 (4 s) credited only the samples started under version 1 or later (4 + 4 + 4
      tokens), not step 2's 10-token sample carried in from step 1: 4000 / 12 ms a token, one carried-in sample;
    - staleness of the six trained samples: 0, 0, 1, 0, 0, 1;
    - a dump whose staleness disagrees with the trainer's data_flow/staleness/max stops it, naming the step;
    - a run cut off before any step (or any after the warm-up) has None there, not a 0 that reads as infinitely
      fast, and says how it ended."""
    from benchmarks.partial_rollout import summarise

    def step(number, seconds, stale_max):
        return {"training/global_step": number, "timing_s/step": seconds, "timing_s/gen": seconds / 2,
                "data_flow/staleness/max": float(stale_max)}

    def sample(tokens, started):
        return {"response_tokens": tokens, "started_version": started}

    steps = [step(1, 2.0, 0), step(2, 3.0, 1), step(3, 1.0, 1)]
    samples = {1: [sample(4, 0), sample(4, 0)], 2: [sample(10, 0), sample(4, 1)], 3: [sample(4, 2), sample(4, 1)]}
    row = summarise("partial", steps, samples, None, warmup=1)
    assert row == {"mode": "partial", "ended": "finished", "steps": 3, "trained tokens": 30, "step s (sum)": 6.0,
                   "gen s (sum)": 3.0, "ms / token": 200.0, "steps after warm-up": 2, "carried-in samples": 1,
                   "ms / token after warm-up": pytest.approx(4000 / 12),
                   "staleness": {"min": 0, "median": 0.0, "max": 1, "histogram": {"0": 4, "1": 2}}}

    steps[2]["data_flow/staleness/max"] = 2.0
    with pytest.raises(SystemExit, match=r"partial, step 3: the dumped samples' staleness reaches 1, the trainer "
                                         r"logged data_flow/staleness/max=2.0"):
        summarise("partial", steps, samples, None, warmup=1)

    warm_only = summarise("baseline", steps[:1], samples, "exit timeout: trainer log line", warmup=1)
    assert warm_only["ended"] == "exit timeout after 1 steps" and warm_only["ms / token"] == 2000 / 8
    assert warm_only["steps after warm-up"] == 0 and warm_only["ms / token after warm-up"] is None
    none = summarise("baseline", [], {}, "exit timeout: trainer log line", warmup=1)
    assert none["ms / token"] is None and none["staleness"] == dict.fromkeys(["min", "median", "max", "histogram"])


def test_ppo_step_runs_name_their_engine_and_a_misspelt_one_is_refused_by_name():
    """ppo_step.py --layouts LAYOUT@ENGINE: the run's rollout.name is that engine, only SGLang's run gets SGLang's
    engine arguments, and an unknown layout or engine stops the benchmark naming both lists."""
    from argparse import Namespace

    from benchmarks.ppo_step import ENGINES, run_name, trainer_overrides

    assert run_name("rmpad32k") == ("rmpad32k", "sglang")
    assert run_name("rmpad32k_async@vllm") == ("rmpad32k_async", "vllm")
    for wrong in ("rmpad32k@vlm", "rmpad99k@vllm"):
        with pytest.raises(SystemExit, match=rf"{wrong!r} is not LAYOUT or LAYOUT@ENGINE .*'rmpad32k'.*'vllm'"):
            run_name(wrong)
    args = Namespace(shape="0.5b", data_dir="/data", gpus=1, prompts=64, n=8, response_length=512, steps=5,
                     gpu_memory_utilization=0.5, engine_log=True)
    sglang, vllm = (trainer_overrides(args, "/model", "/run", engine) for engine in ("sglang", "vllm"))
    assert "actor_rollout_ref.rollout.name=sglang" in sglang and "actor_rollout_ref.rollout.name=vllm" in vllm
    assert [o for o in vllm if "engine_kwargs" in o] == [] and set(ENGINES["sglang"]) <= set(sglang)
    assert "+actor_rollout_ref.rollout.engine_kwargs.sglang.log_level=info" in sglang
    assert set(sglang) - set(vllm) == {*ENGINES["sglang"], "actor_rollout_ref.rollout.name=sglang",
                                       "+actor_rollout_ref.rollout.engine_kwargs.sglang.log_level=info"}


def test_agent_loop_gap_takes_turns_on_one_engine_and_its_summary_is_its_turns_by_hand(tmp_path):
    """benchmarks/agent_loop_gap.py --device cpu, a real run (tiny model, the hf engine, local Ray, the engine server
    on 127.0.0.1): the timed turns go A B B A after the untimed warm-up pair, each one rollout window that made
    tokens, and the summary is those turns' own numbers: the ratio of the paths' seconds per token, each repeat's
    ratio, and the agent turns' mean breakdown."""
    import statistics
    import subprocess

    out = tmp_path / "gap.json"
    run = subprocess.run([sys.executable, "benchmarks/agent_loop_gap.py", "--device", "cpu", "--model-dir",
                          str(tmp_path / "model"), "--turns", "2", "--out", str(out)], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [turn["path"] for turn in record["warmup_turns"]] == ["agent_loops", "batch"]
    turns = record["turns"]
    assert [turn["path"] for turn in turns] == ["agent_loops", "batch", "batch", "agent_loops"]
    assert all(0 < turn["tokens"] <= 4 * 2 * 8 and turn["seconds"] > 0 for turn in turns)
    runs = {path: [(turn["seconds"], turn["tokens"]) for turn in turns if turn["path"] == path]
            for path in ("agent_loops", "batch")}
    seconds_per_token = {path: sum(s for s, _ in path_runs) / sum(t for _, t in path_runs)
                         for path, path_runs in runs.items()}
    summary = record["summary"]
    assert summary["time_ratio"] == pytest.approx(seconds_per_token["batch"] / seconds_per_token["agent_loops"])
    repeats = [(bs / bt) / (s / t) for (s, t), (bs, bt) in zip(runs["agent_loops"], runs["batch"])]
    assert summary["repeat_ratios"] == pytest.approx(repeats)
    low, high = summary["time_ratio_90"]
    assert min(repeats) <= low <= high <= max(repeats)  # a resample's ratio of sums lies within its repeats' range
    agent_turns = [turn for turn in turns if turn["path"] == "agent_loops"]
    assert all(turn["timing_s/server_first_request"] <= turn["timing_s/server_last_request"] for turn in agent_turns)
    # the flow's single-turn path generates through sample_generate.generate, not a loop object: no per-sample loop
    # metrics (timing_s/agent_loop/slowest/*), only the whole call's seconds
    assert not any(key.startswith("timing_s/agent_loop/") for turn in agent_turns for key in turn)
    assert summary["agent_breakdown_mean"]["whole call (s)"] == pytest.approx(
        statistics.mean(turn["timing_s/agent_loop"] for turn in agent_turns))
    assert "agent_loops / batch" in run.stdout


def test_engine_server_requests_measures_both_codecs_and_every_request_of_a_real_server(tmp_path):
    """benchmarks/engine_server_requests.py, a real run (an EngineServer on 127.0.0.1, two client processes through
    AsyncLLMServerManager): both codecs are timed on the same payloads (each round-trips them, checked inside), and
    each server run saw every request and answered every token, first request before last, last before the last
    answer; the median is the runs' own."""
    import statistics
    import subprocess

    out = tmp_path / "server.json"
    run = subprocess.run([sys.executable, "benchmarks/engine_server_requests.py", "--requests", "40", "--clients", "2",
                          "--tokens", "16", "--prompt-tokens", "8", "--runs", "3", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads(out.read_text())
    assert set(record["codec"]) == {"json", "msgspec"}
    assert all(set(row) == {"encode_answers_s", "decode_answers_s", "encode_requests_s", "decode_requests_s"} and
               all(value > 0 for value in row.values()) for row in record["codec"].values())
    servers = record["server_runs"]
    assert len(servers) == 3 and all(one["requests"] == 40 and one["clients"] == 2 for one in servers)
    assert all(0 <= one["first_request_s"] <= one["last_request_s"] <= one["last_answer_s"] for one in servers)
    assert record["server_median"]["last_answer_s"] == pytest.approx(
        statistics.median(one["last_answer_s"] for one in servers))
    assert "last_answer_s" in run.stdout and "listen_overflows" in run.stdout


def test_the_time_ratio_sums_seconds_per_token_over_repeats_and_resamples_them():
    """agent_loop_gap.time_ratio by hand.
    - Repeats of one ratio give exactly it, point and interval: batch 2 s against agent 3 s for the same tokens is 2/3.
    - Tokens count: agent 2 s for 4 tokens (0.5 s each) against batch 1 s for 1 token is 2.0, not 0.5.
    - Agent (1 s, 2 s) against batch (1 s, 1 s), one token each: the times' ratio is 2/3 (not 0.75, the mean of the
      repeats' 1 and 0.5); a resample of 2 is both first (1), both second (0.5, a quarter of the time, more than 5 %)
      or one of each (2/3), so the 5th percentile is 0.5 and the 95th 1.
    - Unequal repeat counts are refused."""
    from benchmarks.agent_loop_gap import time_ratio

    same = time_ratio([(3.0, 10), (6.0, 20), (9.0, 30)], [(2.0, 10), (4.0, 20), (6.0, 30)])
    assert same["time_ratio"] == pytest.approx(2 / 3) and same["time_ratio_90"] == pytest.approx([2 / 3, 2 / 3])
    assert time_ratio([(2.0, 4)], [(1.0, 1)])["time_ratio"] == 2.0
    two = time_ratio([(1.0, 1), (2.0, 1)], [(1.0, 1), (1.0, 1)])
    assert two["time_ratio"] == pytest.approx(2 / 3) and two["repeat_ratios"] == [1.0, 0.5]
    assert two["time_ratio_90"] == [0.5, 1.0]
    with pytest.raises(ValueError, match="one pair a repeat.*got 2 and 1"):
        time_ratio([(1.0, 1), (2.0, 1)], [(1.0, 1)])


def test_decode_lines_are_read_per_turn_and_summarized_per_path(tmp_path):
    """agent_loop_gap.decode_lines_by_turn on a log laid out as a run writes it (turn markers on stdout, SGLang's
    decode lines between them, other lines anywhere): each path's turns and lines, and the median of the rates of the
    lines at 90 % of the turn's largest batch or more (the batch turn's 100-request line and the last agent turn's
    400-request line are left out; the line before the first marker belongs to no turn)."""
    from benchmarks.agent_loop_gap import TURN_MARKER, decode_lines_by_turn

    def line(running, rate):
        return (f"[2026-12-02 06:45:01] Decode batch, #running-req: {running}, #token: 9, token usage: 0.01, "
                f"cuda graph: True, gen throughput (token/s): {rate}, #queue-req: 0")

    log = tmp_path / "run.log"
    log.write_text("\n".join([line(512, 1.0), f"{TURN_MARKER}agent_loops 0", line(500, 80.0), "other output",
                              line(512, 90.0), f"{TURN_MARKER}batch 1", line(512, 95.0), line(100, 10.0),
                              f"{TURN_MARKER}agent_loops 2", line(400, 70.0), line(512, 85.0)]) + "\n")
    assert decode_lines_by_turn(str(log)) == {
        "agent_loops": {"turns": 2, "lines_per_turn": 2, "full_batch_tok_per_s_median": 85.0},  # of 80, 90, 85
        "batch": {"turns": 1, "lines_per_turn": 2, "full_batch_tok_per_s_median": 95.0}}


def test_ppo_step_vary_takes_turns_a_b_b_a_and_sums_each_values_steps_by_hand():
    """ppo_step.py --vary KEY=A,B: the one layout at A, B, B, A (the override last, so it wins), the runs named by value
    and turn, and the summary each value's steps in run order with the ratio of the means, as computed here."""
    from benchmarks.ppo_step import parse_vary, planned_runs, vary_summary

    key = "actor_rollout_ref.rollout.enforce_eager"
    vary = parse_vary(f"{key}=false,true")
    assert vary == (key, ["false", "true"]) and parse_vary(None) is None
    runs = planned_runs(["rmpad32k@vllm"], vary)
    assert runs == [("rmpad32k@vllm|enforce_eager=false#1", "rmpad32k@vllm", [f"{key}=false"]),
                    ("rmpad32k@vllm|enforce_eager=true#1", "rmpad32k@vllm", [f"{key}=true"]),
                    ("rmpad32k@vllm|enforce_eager=true#2", "rmpad32k@vllm", [f"{key}=true"]),
                    ("rmpad32k@vllm|enforce_eager=false#2", "rmpad32k@vllm", [f"{key}=false"])]
    assert planned_runs(["rmpad", "padded"], None) == [("rmpad", "rmpad", []), ("padded", "padded", [])]
    with pytest.raises(SystemExit, match="--vary: expected one layout in --layouts, got 2: rmpad,padded"):
        planned_runs(["rmpad", "padded"], vary)  # the summary pools a value's runs: they may differ in nothing else
    for wrong in (f"{key}=1", f"{key}=1,2,3", "=1,2", f"{key}=1,"):
        with pytest.raises(SystemExit, match="--vary: expected KEY=A,B"):
            parse_vary(wrong)
    gen = {"false#1": [8.0, 7.0], "true#1": [6.0], "true#2": [5.0, 7.0], "false#2": [9.0]}  # the last run cut short
    results = {f"rmpad32k@vllm|enforce_eager={turn}": {"steps/timing_s/gen": seconds,
                                                       "steps/timing_s/step": [s + 10 for s in seconds]}
               for turn, seconds in gen.items()}
    summary = vary_summary(results, vary)
    assert summary["values"]["false"]["gen"] == [8.0, 7.0, 9.0] and summary["values"]["true"]["gen"] == [6.0, 5.0, 7.0]
    assert summary["gen_ratio_true_over_false"] == pytest.approx(6.0 / 8.0)
    assert summary["step_ratio_true_over_false"] == pytest.approx(16.0 / 18.0)
