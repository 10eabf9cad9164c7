"""The reward hub (issue #15 point 6): named scorers, the remote reward model on a real local HTTP server,
the reward managers built from custom_reward_function.rm_type, and the async per-group entry point."""
import asyncio
import threading
import time
from collections import Counter

import pytest
from aiohttp import web

from hybridrl.config import compose_config, validate_config
from hybridrl.config.validation import ConfigError
from hybridrl.reward.hub import RewardHub, RewardInput, score_group
from hybridrl.reward.managers import load_reward_manager
from hybridrl.reward.remote_rm import RemoteRewardModel
from hybridrl.reward.scorers import deepscaler, default_compute_score, f1, math_dapo
from hybridrl.defaults.tiny_model import build_tokenizer
from tests.test_reward_manager import make_batch


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["#### 7 so 7 then #### 8 the sum", "so \\boxed{the cat sat} on the mat q any"] * 5)


# ---------------------------------------------------------------------------------------------- DAPO (math_dapo)

@pytest.mark.parametrize("response, ground_truth, score, pred", [
    ("so the total is 42.\nAnswer: 42", "42", 1.0, "42"),
    ("Answer: 41\nno wait. Answer: 42", "42", 1.0, "42"),           # the last "Answer:" counts
    ("answer: 1,000 dollars", "1000", 1.0, "1000"),               # units dropped, thousands separator too
    ("Answer: x = 5", "5", 1.0, "5"),                             # left-hand side dropped
    ("Answer: $\\frac12$", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),  # $...$ unwrapped, \frac12 braced
    ("Answer: 43", "42", -1.0, "43"),
    ("the answer is 42", "42", -1.0, "[INVALID]"),                # no "Answer:" line: wrong, not neutral
    ("Answer: 42" + " padding" * 50, "42", -1.0, "[INVALID]"),    # only the last 300 characters are read
])
def test_dapo_scorer(response, ground_truth, score, pred):
    assert math_dapo.compute_score(response, ground_truth) == {"score": score, "acc": score > 0, "pred": pred}


def test_dapo_strict_box_and_verl_data_sources():
    assert math_dapo.compute_score("... \\boxed{7}", "7", strict_box_verify=True)["score"] == 1.0
    assert math_dapo.compute_score("... \\boxed{7.0}", "7", strict_box_verify=True)["score"] == -1.0
    for source in ("math_dapo", "math", "math_dapo_reasoning", "aime2024"):
        assert default_compute_score(source, "Answer: 12", "12") == {"score": 1.0, "acc": True, "pred": "12"}


# ---------------------------------------------------------------------------------------------- deepscaler

@pytest.mark.parametrize("response, ground_truth, expected", [
    ("<think>maybe \\boxed{5}</think> so \\boxed{6}", "6", 1.0),
    ("<think>maybe \\boxed{6}</think> so \\boxed{5}", "6", 0.0),   # only the answer after the reasoning
    ("no think tags \\boxed{6}", "6", 0.0),                         # reasoning never closed
    ("<think>x</think> six", "6", 0.0),                             # no boxed answer
    ("<think>x</think> \\boxed{6}", "\\boxed{6}", 1.0),             # a boxed ground truth is unboxed
    ("<think>x</think> \\boxed{6}", ["7", "6"], 1.0),               # any of several ground truths
    ("<think>x</think> \\boxed{\\dfrac12}", "0.5", 1.0),            # MATH normalisation
    ("<think>x</think> \\boxed{2/4}", "\\frac{1}{2}", 1.0),         # math-verify proves it
    ("###Response \\boxed{6}", "6", 1.0),
])
def test_deepscaler_scorer(response, ground_truth, expected):
    assert deepscaler.compute_score(response, ground_truth) == expected


# ---------------------------------------------------------------------------------------------- F1

def test_f1_by_hand():
    # "The cat sat." -> "cat sat"; "cat sat on the mat" -> "cat sat on mat": 2 shared, P = 2/2, R = 2/4
    assert f1.f1_precision_recall("The cat sat.", "cat sat on the mat") == pytest.approx((2 / 3, 1.0, 0.5))
    assert f1.compute_score("Paris, France", ["London", "paris"]) == pytest.approx(2 / 3)  # best reference
    assert f1.compute_score("the the the", "the") == 0.0  # only articles: no tokens left
    assert f1.compute_score("yes it is", "yes") == 0.0    # yes/no must match exactly
    assert f1.compute_score("No!", "no") == 1.0
    assert f1.compute_score("a b a", "a b b") == pytest.approx(2 / 3)  # "a" is an article: "b" vs "b b"
    assert f1.compute_score("x y x", "x y y") == pytest.approx(2 / 3)  # multiset overlap: 2 of 3 each side


# ---------------------------------------------------------------------------------------------- selection

def config_with(*overrides):
    return validate_config(compose_config(list(overrides)))


def test_rm_type_selects_the_scorer_for_every_sample_and_a_row_may_choose_its_own(tokenizer):
    config = config_with("custom_reward_function.rm_type=boxed_f1")
    manager = load_reward_manager(config, tokenizer, num_examine=0)
    responses = ["so \\boxed{the cat sat}", "so \\boxed{the cat sat}", "#### 7"]
    batch = make_batch(tokenizer, ["q"] * 3, responses, ["any"] * 3, ["cat sat on the mat", "cat", "7"],
                       extra_infos=[{}, {"rm_type": "f1"}, {"rm_type": "gsm8k"}])
    scores = manager(batch).sum(-1).tolist()
    # boxed "the cat sat" vs "cat sat on the mat": 2/3; row 1 scores the whole text, "so boxedthe cat sat" once
    # normalised, against "cat": P 1/4, R 1 -> 0.4; row 2 its own gsm8k scorer
    assert scores == pytest.approx([2 / 3, 0.4, 1.0])


def test_rm_type_validation_names_the_key():
    with pytest.raises(ConfigError) as error:
        config_with("custom_reward_function.rm_type=mathh")
    assert any(p.startswith("custom_reward_function.rm_type: expected a reward-hub scorer, got 'mathh'")
               for p in error.value.problems)
    with pytest.raises(ConfigError) as error:
        config_with("custom_reward_function.rm_type=remote_rm")
    assert any(p.startswith("custom_reward_function.remote_rm.url: expected") for p in error.value.problems)
    with pytest.raises(ConfigError) as error:  # 3 attempts x 120 s cannot fit in the 300 s score_timeout
        config_with("custom_reward_function.rm_type=remote_rm", "custom_reward_function.remote_rm.url=http://x:1",
                    "custom_reward_function.remote_rm.timeout=120")
    assert any(p.startswith("custom_reward_function.remote_rm.timeout: expected timeout * (max_retries + 1)")
               for p in error.value.problems)


# ---------------------------------------------------------------------------------------------- remote reward model

class RewardServer:
    """A real aiohttp server on 127.0.0.1 in its own thread. POST /score: score = len(response) / 10, echoes the
    prompt; /slow answers only once the server closes (HOLD_S at most), never within a client's timeout; /flaky
    answers 503 on a response's first attempt; /bad is a 400; /garbage no JSON, /nan a NaN score. A request with
    a prompt gets {"score", "prompt_seen"}, one without a plain number. `attempts` counts requests per (path,
    response); `peak_in_flight` is the most /score requests the server held at once. With `hold_until` = n, a
    /score request waits until n of them are in the server (HOLD_S at most) before it answers, so concurrency
    shows as a count rather than as a time, which a loaded machine could stretch."""

    HOLD_S = 30.0  # only a failing test waits this long: requests sent at once all arrive well within it

    def __init__(self):
        self.attempts = Counter()
        self.hold_until = 0
        self.in_flight = self.peak_in_flight = 0
        self.all_in = asyncio.Event()  # bound to the server's loop on first use (Python 3.10+)
        self.closing = asyncio.Event()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(60)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}/{path}"

    async def _handle(self, request):
        payload = await request.json()
        path = request.path.strip("/")
        self.attempts[(path, payload["response"])] += 1
        if path == "slow":
            await self._wait(self.closing)
        if path == "flaky" and self.attempts[(path, payload["response"])] == 1:
            return web.Response(status=503, text="busy")
        if path == "bad":
            return web.Response(status=400, text="bad request")
        if path == "garbage":
            return web.Response(text="nope")
        if path == "nan":
            return web.Response(text='{"score": NaN}')
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.in_flight >= self.hold_until:
                self.all_in.set()
            await self._wait(self.all_in)
        finally:
            self.in_flight -= 1
        if payload["prompt"] is None:
            return web.json_response(len(payload["response"]) / 10)
        return web.json_response({"score": len(payload["response"]) / 10, "prompt_seen": payload["prompt"]})

    async def _wait(self, event):
        try:
            await asyncio.wait_for(event.wait(), self.HOLD_S)
        except asyncio.TimeoutError:
            pass

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/{path}", self._handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        self.loop.call_soon_threadsafe(self.closing.set)  # /slow requests still held answer now
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


@pytest.fixture
def server():
    server = RewardServer()
    yield server
    server.close()


def remote_hub(url, timeout=60.0, max_retries=1, retry_delay=0.05):
    """A hub on the test server; the default timeout is one that no answer of the local server can hit, however
    loaded the machine (a timed-out attempt would be retried and change the attempt counts)."""
    return RewardHub(rm_type="remote_rm", remote=RemoteRewardModel(url, timeout, max_retries, retry_delay, 16))


def test_score_group_scores_a_group_concurrently_with_the_prompt(server):
    """The server holds every request until all 8 are in: only a client that sends them at once gets answers
    without waiting the server's HOLD_S, and the server's count of requests in flight shows 8 at once."""
    server.hold_until = 8
    samples = [RewardInput(response="x" * (i + 1), label="l", data_source="d", prompt=f"p{i}") for i in range(8)]
    scores = asyncio.run(score_group(samples, remote_hub(server.url("score"))))
    assert [s.reward for s in scores] == pytest.approx([(i + 1) / 10 for i in range(8)])
    assert [s.extra for s in scores] == [{"prompt_seen": f"p{i}"} for i in range(8)]
    assert all(s.error is None for s in scores)
    assert server.peak_in_flight == 8, f"at most {server.peak_in_flight} of 8 requests in flight: not concurrent"


def test_a_server_that_times_out_is_retried_then_the_sample_is_an_error(server):
    """/slow does not answer while a client waits, so only the client's own timeout can end an attempt: the
    error names the attempts, the per-attempt timeout and a timeout as the last problem, and the server saw
    exactly 2 attempts. That bounds the sample by worst_case_seconds() without timing it (lower bound only)."""
    hub = remote_hub(server.url("slow"), timeout=0.3, max_retries=1, retry_delay=0.1)
    started = time.monotonic()
    scores = asyncio.run(score_group([RewardInput("abc", "l")], hub))
    elapsed = time.monotonic() - started
    assert scores[0].reward == 0.0
    assert "gave no score after 2 attempt(s) (timeout 0.3 s each); last: TimeoutError" in scores[0].error
    assert server.attempts[("slow", "abc")] == 2
    assert elapsed >= 0.3 * 2 + 0.1  # both attempts waited out their timeout, with the retry delay between
    assert hub.remote.worst_case_seconds() == pytest.approx(0.7)


def test_transient_errors_are_retried_and_client_errors_are_not(server):
    flaky = asyncio.run(score_group([RewardInput("abcd", "l")], remote_hub(server.url("flaky"))))
    assert flaky[0].reward == pytest.approx(0.4) and server.attempts[("flaky", "abcd")] == 2
    bad = asyncio.run(score_group([RewardInput("abcd", "l")], remote_hub(server.url("bad"), max_retries=3)))
    assert "HTTP 400" in bad[0].error and server.attempts[("bad", "abcd")] == 1
    garbage = asyncio.run(score_group([RewardInput("abcd", "l")], remote_hub(server.url("garbage"))))
    assert "answered no JSON" in garbage[0].error
    not_finite = asyncio.run(score_group([RewardInput("abcd", "l")], remote_hub(server.url("nan"))))
    assert "expected a finite number" in not_finite[0].error and server.attempts[("nan", "abcd")] == 1


@pytest.mark.parametrize("manager", ["naive", "batch"])
def test_reward_managers_score_with_a_remote_reward_model(server, tokenizer, manager):
    config = config_with("custom_reward_function.rm_type=remote_rm", f"custom_reward_function.remote_rm.url="
                         f"{server.url('score')}", f"reward_model.reward_manager={manager}")
    reward_fn = load_reward_manager(config, tokenizer, num_examine=0)
    responses = ["#### 7", "so 7 then", "the sum"]
    batch = make_batch(tokenizer, ["q"] * 3, responses, ["d"] * 3, ["7"] * 3,
                       extra_infos=[{}, {}, {"rm_type": "gsm8k"}])
    result = reward_fn(batch, return_dict=True)
    decoded = [tokenizer.decode(tokenizer(r, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
               for r in responses[:2]]
    assert result["reward_tensor"].sum(-1).tolist() == pytest.approx([len(text) / 10 for text in decoded] + [0.0])
    assert result["reward_metrics"]["reward/errors"] == 0.0
    assert sum(server.attempts.values()) == 2  # the gsm8k row never went to the server


@pytest.mark.parametrize("manager", ["naive", "batch"])
def test_reward_managers_count_a_dead_server_as_errors(tokenizer, manager):
    config = config_with("custom_reward_function.rm_type=remote_rm",
                         "custom_reward_function.remote_rm.url=http://127.0.0.1:9/score",  # discard port: refused
                         "custom_reward_function.remote_rm.timeout=0.5",
                         "custom_reward_function.remote_rm.max_retries=1",
                         "custom_reward_function.remote_rm.retry_delay=0.01", f"reward_model.reward_manager={manager}")
    reward_fn = load_reward_manager(config, tokenizer, num_examine=0)
    batch = make_batch(tokenizer, ["q"] * 2, ["#### 7", "#### 8"], ["d"] * 2, ["7", "8"],
                       extra_infos=[{}, {"rm_type": "gsm8k"}])
    result = reward_fn(batch, return_dict=True)
    assert result["reward_tensor"].sum(-1).tolist() == [0.0, 1.0]  # the remote one failed, gsm8k scored
    assert result["reward_metrics"]["reward/errors"] == 1.0


def test_score_group_runs_rule_scorers_and_reports_bad_scores():
    async def group():
        hub = RewardHub(rm_type="dapo")
        return await score_group([RewardInput("Answer: 3", "3"), RewardInput("Answer: 4", "3"),
                                  RewardInput("Answer: 3", "3", extra_info={"rm_type": "f1"})], hub)
    scores = asyncio.run(group())
    assert [s.reward for s in scores] == pytest.approx([1.0, -1.0, 2 / 3])  # f1: "answer 3" vs "3": P 1/2, R 1
    assert scores[0].extra == {"acc": True, "pred": "3"}


def test_score_group_awaits_an_async_user_function_and_catches_nan():
    async def judge(data_source, solution_str, ground_truth, extra_info=None):
        await asyncio.sleep(0)
        return float("nan") if solution_str == "bad" else 0.25

    scores = asyncio.run(score_group([RewardInput("ok", "x"), RewardInput("bad", "x")], RewardHub(custom_fn=judge)))
    assert scores[0].reward == 0.25 and scores[0].error is None
    assert scores[1].reward == 0.0 and "not finite" in scores[1].error


def test_score_group_gives_up_on_a_stuck_scorer_after_score_timeout():
    """The slow scorer is held until the group has returned, so the group coming back at all proves it gave up
    on the stuck thread instead of waiting for it (no wall-time bound). score_timeout=2 s leaves the fast
    scorer's thread ample time to run on a loaded machine."""
    release, slow_finished = threading.Event(), threading.Event()

    def stuck(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "slow":
            release.wait(120)
            slow_finished.set()
        return 1.0

    async def group():  # asyncio.run itself waits for the abandoned thread at its end; the group does not
        try:
            scores = await score_group([RewardInput("slow", "x"), RewardInput("fast", "x")],
                                       RewardHub(custom_fn=stuck, score_timeout=2.0))
            return scores, slow_finished.is_set()
        finally:
            release.set()

    scores, finished_before_the_group = asyncio.run(group())
    assert not finished_before_the_group
    assert scores[0].reward == 0.0 and scores[0].error.startswith("TimeoutError")
    assert scores[1].reward == 1.0 and scores[1].error is None


def test_an_invalid_remote_setting_is_reported_without_breaking_the_timeout_rule():
    with pytest.raises(ConfigError) as error:
        config_with("custom_reward_function.rm_type=remote_rm", "custom_reward_function.remote_rm.url=ftp://x",
                    "custom_reward_function.remote_rm.timeout=-1")
    problems = [p for p in error.value.problems if "remote_rm" in p]
    assert len(problems) == 2, problems
    assert problems[0].startswith("custom_reward_function.remote_rm.timeout: expected > 0")
    assert problems[1].startswith("custom_reward_function.remote_rm.url: expected an http:// or https:// URL")
