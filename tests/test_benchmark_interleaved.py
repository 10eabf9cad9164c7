"""hybrid_engine.py's side-by-side timing without a GPU: a standalone engine's process up beside the caller, asked
for one batch at a time over a pipe (StandaloneBeside), and two engines taking turns A B B A (time_interleaved), so
that a host whose speed drifts run to run slows both sides alike."""
import os
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.hybrid_engine import StandaloneBeside, time_interleaved  # noqa: E402


def serve_counting(connection, tokens_per_batch: int) -> None:
    """A stand-in engine process: starts in 0.25 s (sent back), then makes tokens_per_batch * batch number tokens per
    batch asked for, until told to stop."""
    connection.send(0.25)
    batch = 0
    while connection.recv():
        batch += 1
        connection.send(tokens_per_batch * batch)


def serve_failing(connection) -> None:
    connection.send(0.0)
    connection.recv()
    raise ValueError("engine core died: CUDA error: out of memory")


def serve_dying(connection) -> None:
    connection.send(0.0)
    connection.recv()
    os._exit(7)  # no reply, no exception: a process killed mid-batch


def test_the_process_beside_answers_each_batch_asked_for_and_stops_when_closed():
    beside = StandaloneBeside(serve_counting, 100, poll_s=0.2)
    try:
        assert beside.engine_start_s == 0.25
        assert [beside.generate(None) for _ in range(3)] == [100, 200, 300]
    finally:
        beside.close()
    assert beside.process.exitcode == 0


def test_an_error_in_the_process_beside_is_raised_in_the_caller_with_its_message():
    beside = StandaloneBeside(serve_failing, poll_s=0.2)
    try:
        with pytest.raises(RuntimeError, match=r"standalone engine.s process: ValueError.*engine core died: CUDA error: out of memory"):
            beside.generate(None)
    finally:
        beside.close()


def test_a_process_beside_that_dies_without_a_word_fails_the_caller_with_its_exit_code():
    beside = StandaloneBeside(serve_dying, poll_s=0.2)
    started = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match=r"died \(exit code 7\)"):
            beside.generate(None)
    finally:
        beside.close()
    assert time.monotonic() - started < 30


def test_two_engines_take_turns_a_b_b_a_and_each_run_is_timed_on_its_side(monkeypatch):
    calls = []
    clock = iter(range(1000))  # perf_counter: every call a second later, so each run takes 1 s
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)

    def engine(name, tokens):
        def generate(prompts):
            calls.append(name)
            assert prompts == "prompts"
            return tokens
        return generate

    runs = time_interleaved({"hybrid": engine("hybrid", 90), "standalone": engine("standalone", 100)}, "prompts", 4)
    assert calls == ["hybrid", "standalone", "standalone", "hybrid", "hybrid", "standalone", "standalone", "hybrid"]
    assert runs["hybrid"]["tok_per_s_runs"] == [90.0] * 4
    assert runs["standalone"]["tok_per_s"] == 100.0
    assert runs["hybrid"]["pair_ratios"] == [0.9] * 4
    assert "pair_ratios" not in runs["standalone"]


def test_three_sides_take_turns_a_b_c_c_b_a_each_against_the_last(monkeypatch):
    calls = []
    clock = iter(range(1000))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr("torch.cuda.synchronize", lambda: None)

    def engine(name, tokens):
        def generate(prompts):
            calls.append(name)
            return tokens
        return generate

    runs = time_interleaved({"a": engine("a", 80), "b": engine("b", 120), "c": engine("c", 100)}, None, 2)
    assert calls == ["a", "b", "c", "c", "b", "a"]
    assert runs["a"]["pair_ratios"] == [0.8, 0.8]
    assert runs["b"]["pair_ratios"] == [1.2, 1.2]
    assert "pair_ratios" not in runs["c"]


def test_host_cpu_counts_every_process_busy_cores_and_the_steal_share_by_hand():
    from collections import namedtuple

    from benchmarks.vllm_generation_gap import host_cpu

    Times = namedtuple("Times", "user nice system idle iowait irq softirq steal guest guest_nice")
    before = Times(100, 0, 10, 1000, 0, 0, 0, 0, 0, 0)
    after = Times(118, 0, 12, 1016, 2, 0, 0, 2, 5, 0)  # 10 s: 20 busy core-seconds, 2 of steal, guest inside user
    assert host_cpu(before, after, 10.0) == {"host_busy_cores": 2.0, "host_steal_pct": 100 * 2 / 40}


def test_the_hybrid_side_generates_at_its_thread_count_and_the_process_keeps_its_own():
    import torch

    from benchmarks.hybrid_engine import with_threads

    original = torch.get_num_threads()
    torch.set_num_threads(3)  # a count neither side asks for, so a restore that did nothing would show
    seen = []

    def generate(batch):
        seen.append(torch.get_num_threads())
        if batch == "fail":
            raise RuntimeError("engine died")
        return 7

    try:
        assert with_threads(generate, 1)("ok") == 7
        assert torch.get_num_threads() == 3
        with pytest.raises(RuntimeError, match="engine died"):
            with_threads(generate, 2)("fail")
        assert seen == [1, 2] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(original)
