"""What every reward manager does around its scoring function, so naive, batch and dapo differ only in how they score.

One call, `manager(data, return_dict=True)`:
  1. decode each valid response with the policy tokenizer (`decode_responses`);
  2. score them: `score_samples` (per sample in naive/dapo, one call over the batch in batch), each scorer call
     through `score_calls`, which runs up to `max_concurrent` of them at once on a pool of threads;
  3. turn each result into a float: a scorer's float, or its dict's "score" (every other key of the
     dict becomes a per-sample list in `reward_extra_info`);
  4. `final_rewards` may adjust the floats (dapo adds its overlong penalty);
  5. write each reward on the LAST valid response token of a (batch, response_length) float32
     tensor (the trainer stores it as `token_level_scores`), and add the reward model's
     `rm_scores` when the batch has them (RewardModelWorker puts its score on the same token),
     so rule and model rewards combine by a plain sum.

Samples are scored concurrently (`reward_model.max_concurrent` at once, threads): scorers are mostly waiting
(a sandbox, a judge over HTTP, a reward server), so 16 samples of a 2 s scorer take about 2 s, not 32 s. A scorer
that computes in Python (math-verify) holds the GIL and gains little from threads, but loses nothing either.
Results keep the samples' order whatever order the calls finish in; a scorer shared by the threads must not keep
state between calls that depends on their order (verl's reward loop runs them on threads as well).

A sample the scorer fails on costs that sample, not the run (verl's managers let the first exception end the run;
here a scorer that fails on a few odd responses does not). It fails when the scorer raises, or when it returns a
score that is not a finite number: NaN or inf (one NaN reward makes the whole batch's loss NaN, so every optimizer
step would be skipped), a string (even "0.5"), None, a tensor. The sample scores 0 (its dict extras are None), the
failures of the batch are counted in `reward_metrics["reward/errors"]` (the trainer sums them into summary.json's
`reward_errors`), and the first failure a manager sees is logged once, as a warning naming the scorer, the sample
(its data_source and dataset row) and the exception with its traceback. If every sample of a batch fails, the
scorer itself is broken (a wrong data_source, a typo in a custom function): that raises, with the first error
attached, instead of training on zeros.

A scorer that hangs (a judge that never answers, a sandbox that never returns) is reported, not waited on in
silence: with `reward_model.score_timeout` set, the calling thread logs, every `trainer.heartbeat_interval`
seconds, the call that has been busy longest and for how long, and raises ScoreTimeoutError, naming the scorer and
that sample, once a call has been busy for `score_timeout` seconds. (A scorer that holds the GIL in C code stops
the logging too; math-verify's own per-sample timeouts need the main thread, so they are off on the pool's threads.)
"""
from __future__ import annotations

import inspect
import itertools
import logging
import math
import numbers
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.pool import ThreadPool
from typing import Any, Callable, Optional

import numpy as np
import torch

from hybridrl.data.batch_layout import last_one

logger = logging.getLogger(__name__)

ERRORS_METRIC = "reward/errors"
# Scorer calls at once when the config does not say (reward_model.max_concurrent): as many as asyncio's default
# executor, on which verl's reward loop runs synchronous scorers, has threads on a large machine.
DEFAULT_MAX_CONCURRENT = 32


@dataclass
class DecodedResponses:
    """The per-sample inputs of a scorer, one entry per row of the batch."""

    data_sources: list[Any]
    solution_strs: list[str]
    ground_truths: list[Any]
    extra_infos: list[Optional[dict]]
    response_lengths: list[int]  # valid response tokens; the reward sits on token response_lengths[i] - 1
    rows: list[Any]  # the dataset row of each sample (the batch's `index` column), None without that column

    def __len__(self) -> int:
        return len(self.solution_strs)

    def describe(self, sample: int, with_response: bool = False) -> str:
        """How a message names a sample: `sample 3 (data_source 'x', row 17[, response '...'])`."""
        details = [f"data_source {self.data_sources[sample]!r}"]
        if self.rows[sample] is not None:
            details.append(f"row {self.rows[sample]}")
        if with_response:
            details.append(f"response {_preview(self.solution_strs[sample])}")
        return f"sample {sample} ({', '.join(details)})"


class ScorerFailure:
    """A sample the scorer could not score: its call raised, or it returned an invalid score (kept so the batch
    can still be scored)."""

    def __init__(self, error: Exception):
        self.error = error


class InvalidScoreError(ValueError):
    """A scorer returned something other than a finite number as a sample's score."""


class ScoreTimeoutError(TimeoutError):
    """A scorer call has been busy for `reward_model.score_timeout` seconds."""


@dataclass
class ScorerCall:
    """One call of the scoring function: what it scores (for messages) and its keyword arguments."""

    what: str
    kwargs: dict[str, Any]


def decode_responses(data, tokenizer, reward_fn_key: str) -> DecodedResponses:
    """The scorer inputs of `data` (prompts, responses, attention_mask; non-tensor reward_model, reward_fn_key)."""
    responses = data.batch["responses"]
    response_mask = data.batch["attention_mask"][:, data.batch["prompts"].shape[-1]:]
    if reward_fn_key not in data.non_tensor_batch:
        raise KeyError(f"the batch has no column {reward_fn_key!r} (data.reward_fn_key); "
                       f"non-tensor columns: {sorted(data.non_tensor_batch)}")
    extra_infos = with_rollout_fields(data.non_tensor_batch)
    lengths = _valid_lengths(response_mask)
    valid_tokens = [list(itertools.compress(row, mask)) for row, mask in zip(responses.tolist(),
                                                                             response_mask.tolist())]
    return DecodedResponses(
        data_sources=list(data.non_tensor_batch[reward_fn_key]),
        solution_strs=tokenizer.batch_decode(valid_tokens, skip_special_tokens=True),  # one call: half the time
        ground_truths=[reward_model["ground_truth"] for reward_model in data.non_tensor_batch["reward_model"]],
        extra_infos=[None] * len(responses) if extra_infos is None else list(extra_infos),
        response_lengths=lengths,
        rows=list(data.non_tensor_batch.get("index", [None] * len(responses))))


# Columns an agent loop leaves in the batch that reach the scorer through extra_info, under verl's names: turns of
# the conversation, each tool call's step reward, each tool's calc_reward, and each interaction turn's score. A
# custom reward function adds tool or interaction rewards to the score from these.
ROLLOUT_FIELDS = {"__num_turns__": "num_turns", "tool_rewards": "tool_rewards",
                  "reward_scores": "rollout_reward_scores", "turn_scores": "turn_scores"}


def with_rollout_fields(non_tensor_batch: dict):
    """Each row's extra_info, plus the ROLLOUT_FIELDS columns present (None when there is neither)."""
    extra_infos = non_tensor_batch.get("extra_info")
    present = {column: key for column, key in ROLLOUT_FIELDS.items() if column in non_tensor_batch}
    if not present:
        return extra_infos
    rows = len(non_tensor_batch[next(iter(present))])
    merged = []
    for row in range(rows):
        extra_info = dict(extra_infos[row] or {}) if extra_infos is not None else {}
        for column, key in present.items():
            extra_info[key] = non_tensor_batch[column][row]
        merged.append(extra_info)
    return merged


def rewards_on_last_tokens(responses: torch.Tensor, rewards: list[float], lengths: list[int]) -> torch.Tensor:
    """A (batch, response_length) float32 tensor of zeros but for each row's reward on its last valid token (the
    token lengths[row] - 1), written in one scatter: a write per row cost 0.5 ms on 128 rows, this 0.05 ms."""
    columns = torch.tensor(lengths, dtype=torch.long, device=responses.device).sub_(1).unsqueeze(1)
    values = torch.tensor(rewards, dtype=torch.float32, device=responses.device).unsqueeze(1)
    return torch.zeros(responses.shape, dtype=torch.float32, device=responses.device).scatter_(1, columns, values)


def _valid_lengths(response_mask: torch.Tensor) -> list[int]:
    """Responses are right-padded: each row's valid tokens are the first ones, up to the last 1 of its mask."""
    lengths = last_one(response_mask) + 1
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"sample {empty[0]} has an empty response (no valid token to put its reward on)")
    return lengths.tolist()


class RewardManagerBase:
    """Subclasses implement `score_samples`; see the module docstring for the whole call."""

    def __init__(self, tokenizer, num_examine: int, compute_score: Callable, reward_fn_key: str = "data_source"):
        self.tokenizer = tokenizer
        self.num_examine = num_examine  # how many decoded samples per data source to print
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self._failure_warned = False
        self.max_concurrent = DEFAULT_MAX_CONCURRENT
        self._pool: Optional[ThreadPool] = None  # made by the first scoring, kept: a step's threads cost more than
        # its scoring (32 threads: 11 ms against 2 ms for 128 exact-match scores on 2 loaded cores)
        self.score_timeout: Optional[float] = None  # None: unwatched
        self.heartbeat_interval = 30.0

    def set_score_timeout(self, score_timeout: Optional[float], heartbeat_interval: float) -> None:
        """Watch every scoring (see the module docstring); the loader sets them from the config."""
        self.score_timeout = score_timeout
        self.heartbeat_interval = heartbeat_interval

    def set_max_concurrent(self, max_concurrent: int) -> None:
        """Scorer calls at once, >= 1 (see the module docstring); the loader sets it from the config."""
        self.max_concurrent = max_concurrent
        self._drop_pool()

    def score_samples(self, decoded: DecodedResponses) -> list:
        """One result per sample: a float, a dict with "score", or a ScorerFailure (from `score_calls`)."""
        raise NotImplementedError

    def final_rewards(self, scores: list[float], decoded: DecodedResponses) -> tuple[list[float], dict[str, list]]:
        """The reward of each sample from its score, plus per-sample extras of the manager's own (none here)."""
        return scores, {}

    def score_calls(self, calls: list[ScorerCall]) -> list:
        """`compute_score(**call.kwargs)` of every call, in the calls' order, up to `max_concurrent` at once; a call
        that raises gives a ScorerFailure. With `score_timeout` set, this thread watches the calls meanwhile."""
        if not calls:
            return []
        busy_since: dict[int, float] = {}  # calls running now -> when each began
        lock = threading.Lock()

        def call(number: int):
            with lock:
                busy_since[number] = time.monotonic()
            try:
                return self.compute_score(**calls[number].kwargs)
            except Exception as error:  # noqa: BLE001 — any scorer bug costs its sample(s), not the run
                return ScorerFailure(error)
            finally:
                with lock:
                    del busy_since[number]

        results: list = [None] * len(calls)
        not_started = iter(range(len(calls)))

        def take_calls(_) -> None:
            # One thread's calls: the next one not started, until none is left. Handing the pool one task per call
            # cost more than exact-match scoring itself (each result passed through the pool's result thread: 5.4
            # ms for 128 calls in the controller, against 1.7 ms of scoring); this way a thread runs calls back to
            # back while it holds the GIL, and a waiting scorer's thread still leaves the others to run.
            while True:
                with lock:
                    number = next(not_started, None)
                if number is None:
                    return
                results[number] = call(number)

        threads = min(self.max_concurrent, len(calls))
        pending = self._scoring_pool().map_async(take_calls, range(threads), chunksize=1)
        try:
            if self.score_timeout is None:
                pending.wait()
            else:
                self._watch(pending, calls, busy_since, lock)
        except BaseException:
            self._drop_pool()  # a call still running keeps its thread; the next scoring starts fresh ones
            raise
        pending.get()  # raises what a thread raised past `call` (not an Exception: KeyboardInterrupt, ...)
        return results

    def _scoring_pool(self) -> ThreadPool:
        """The manager's `max_concurrent` scoring threads. ThreadPool's threads are daemons: a scorer stuck past the
        timeout cannot keep the process from ending."""
        if self._pool is None:
            self._pool = ThreadPool(self.max_concurrent)
        return self._pool

    def _drop_pool(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None

    def _watch(self, pending, calls: list[ScorerCall], busy_since: dict[int, float], lock: threading.Lock) -> None:
        """Wait for `pending`, logging the longest-busy call every heartbeat_interval, failing at score_timeout."""
        def longest_busy() -> tuple[Optional[int], float]:
            with lock:
                if not busy_since:
                    return None, 0.0
                number = min(busy_since, key=lambda n: (busy_since[n], n))
                return number, time.monotonic() - busy_since[number]

        next_report = time.monotonic() + self.heartbeat_interval
        while True:
            _, busy_for = longest_busy()
            pending.wait(max(0.0, min(next_report - time.monotonic(), self.score_timeout - busy_for)))
            if pending.ready():
                return
            number, busy_for = longest_busy()
            if number is None:
                continue
            if busy_for >= self.score_timeout:
                # The stuck thread cannot be stopped; it is a daemon, and the run fails now.
                raise ScoreTimeoutError(
                    f"reward_model.score_timeout={self.score_timeout:g} s exceeded: scorer "
                    f"{scorer_name(self.compute_score)} has been busy for {_tenths(busy_for)} s with "
                    f"{calls[number].what}; fix the scorer or raise reward_model.score_timeout (null: no limit)")
            if time.monotonic() >= next_report:
                logger.warning("reward scoring: scorer %s has been busy for %s s with %s (the run fails at "
                               "reward_model.score_timeout=%g s)", scorer_name(self.compute_score), _tenths(busy_for),
                               calls[number].what, self.score_timeout)
                next_report += self.heartbeat_interval

    def __call__(self, data, return_dict: bool = False):
        decoded = decode_responses(data, self.tokenizer, self.reward_fn_key)
        results = self.score_samples(decoded)
        if len(results) != len(decoded):
            raise ValueError(f"{type(self).__name__}.score_samples returned {len(results)} results "
                             f"for {len(decoded)} samples")
        results = [self._checked(result, i, decoded) for i, result in enumerate(results)]
        self._refuse_or_warn(results, decoded)
        scores, score_extras, errors = _resolve(results, decoded.data_sources)
        rewards, manager_extras = self.final_rewards(scores, decoded)
        clash = sorted(set(score_extras) & set(manager_extras))
        if clash:
            raise ValueError(f"the scorer returned extra keys {clash} that {type(self).__name__} also reports")

        reward_tensor = _add_rm_scores(rewards_on_last_tokens(data.batch["responses"], rewards,
                                                              decoded.response_lengths), data)
        self._print_examples(data, decoded, rewards, results)

        if not return_dict:
            return reward_tensor
        return {"reward_tensor": reward_tensor, "reward_extra_info": {**score_extras, **manager_extras},
                "reward_metrics": {ERRORS_METRIC: float(errors)}}

    def _checked(self, result, sample: int, decoded: DecodedResponses):
        """The scorer's result, or a ScorerFailure when its score is not a finite number."""
        if isinstance(result, ScorerFailure) or (isinstance(result, dict) and "score" not in result):
            return result  # a dict without "score" breaks the scorer contract: _split_score raises for it
        problem = invalid_score_problem(result["score"] if isinstance(result, dict) else result)
        if problem is None:
            return result
        return ScorerFailure(InvalidScoreError(f"{scorer_name(self.compute_score)} returned {problem} for "
                                               f"{decoded.describe(sample, with_response=True)}"))

    def _refuse_or_warn(self, results: list, decoded: DecodedResponses) -> None:
        """Every sample failed: raise, naming the first. Some failed: warn once per manager, naming the first."""
        failed = [i for i, result in enumerate(results) if isinstance(result, ScorerFailure)]
        if not failed:
            return
        first, error = failed[0], results[failed[0]].error
        if isinstance(error, InvalidScoreError):
            happened = str(error)
        else:
            happened = f"{scorer_name(self.compute_score)} raised {type(error).__name__}: {error} for " \
                       f"{decoded.describe(first)}"
        if len(failed) == len(results):
            raise RuntimeError(f"the reward scorer failed on all {len(results)} samples of the batch (it raised or "
                               f"returned no finite number), so the scorer itself is broken; first: {happened}") \
                from error
        if self._failure_warned:
            return
        self._failure_warned = True
        logger.warning("reward scorer failed on %d of %d samples: %s; a failed sample scores 0 and is counted in %s "
                       "and in summary.json's reward_errors (this warning is shown once)", len(failed), len(results),
                       happened, ERRORS_METRIC,
                       exc_info=None if isinstance(error, InvalidScoreError) else error)

    def _print_examples(self, data, decoded: DecodedResponses, rewards: list[float], results: list) -> None:
        printed_per_source: dict[Any, int] = defaultdict(int)
        prompts = data.batch["prompts"]
        prompt_mask = data.batch["attention_mask"][:, :prompts.shape[-1]]
        for i, data_source in enumerate(decoded.data_sources):
            if printed_per_source[data_source] >= self.num_examine:
                continue
            printed_per_source[data_source] += 1
            prompt_str = self.tokenizer.decode(prompts[i][prompt_mask[i].bool()], skip_special_tokens=True)
            extras = results[i] if isinstance(results[i], dict) else {}
            failure = f"\n[error] {results[i].error!r}" if isinstance(results[i], ScorerFailure) else ""
            print(f"[prompt] {prompt_str}\n[response] {decoded.solution_strs[i]}\n"
                  f"[ground_truth] {decoded.ground_truths[i]}\n[score] {rewards[i]}"
                  + "".join(f"\n[{key}] {value}" for key, value in extras.items() if key != "score") + failure)


def invalid_score_problem(score) -> Optional[str]:
    """None for a finite real number (bools and numpy scalars included); else what is wrong with `score`."""
    if isinstance(score, str):
        return f"the string {score!r} (not a number)"
    if not isinstance(score, (numbers.Real, np.bool_)):
        return f"{score!r} of type {type(score).__name__} (not a number)"
    if not math.isfinite(score):
        return f"{score!r} (not finite)"
    return None


def scorer_name(function: Callable) -> str:
    """How a log line names a scoring function: its qualified name and the file it is defined in."""
    name = getattr(function, "__qualname__", None) or repr(function)
    try:
        source = inspect.getsourcefile(function)
    except TypeError:  # a builtin, a functools.partial, a callable object
        source = None
    return f"{name} ({source})" if source else name


def _tenths(seconds: float) -> str:
    """Seconds rounded down to tenths: a report never claims more time than has passed (1.96 s is 1.9, not 2.0)."""
    return f"{math.floor(seconds * 10) / 10:.1f}"


def _preview(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _resolve(results: list, data_sources: list) -> tuple[list[float], dict[str, list], int]:
    """Scores (0 for failures), extras as one list per key (None for failures), and the failure count."""
    failures = [result for result in results if isinstance(result, ScorerFailure)]
    scores, extras_per_sample = [], []
    for result, data_source in zip(results, data_sources):
        if isinstance(result, ScorerFailure):
            scores.append(0.0)
            extras_per_sample.append(None)
        else:
            score, extras = _split_score(result, data_source)
            scores.append(score)
            extras_per_sample.append(extras)
    return scores, _columns(extras_per_sample), len(failures)


def _split_score(result, data_source) -> tuple[float, dict[str, Any]]:
    """A scorer's float, or its dict's "score" plus the other keys."""
    if isinstance(result, dict):
        if "score" not in result:
            raise KeyError(f"the scorer for {data_source!r} returned a dict without 'score': keys {sorted(result)}")
        extras = {key: value for key, value in result.items() if key != "score"}
        return float(result["score"]), extras
    return float(result), {}


def _columns(extras_per_sample: list[Optional[dict[str, Any]]]) -> dict[str, list]:
    """Per-sample extras -> one list per key. Every scored sample must report the same keys, so lists line
    up; a failed sample (None) gets None under every key."""
    scored = [(i, extras) for i, extras in enumerate(extras_per_sample) if extras is not None]
    if not scored:
        return {}
    first_index, first = scored[0]
    keys = set(first)
    for i, extras in scored:
        if set(extras) != keys:
            raise ValueError(f"sample {i} returned extra keys {sorted(extras)}, sample {first_index} returned "
                             f"{sorted(keys)}; every sample of a batch must return the same keys")
    return {key: [None if extras is None else extras[key] for extras in extras_per_sample] for key in sorted(keys)}


def _add_rm_scores(reward_tensor: torch.Tensor, data) -> torch.Tensor:
    """Rule rewards plus the reward model's `rm_scores` (same shape, score on the same last token) when present."""
    rm_scores = data.batch.get("rm_scores")
    if rm_scores is None:
        return reward_tensor
    if rm_scores.shape != reward_tensor.shape:
        raise ValueError(f"batch['rm_scores'] has shape {tuple(rm_scores.shape)}, the responses "
                         f"{tuple(reward_tensor.shape)}; RewardModelWorker.compute_rm_score gives one per response token")
    return reward_tensor + rm_scores.to(device=reward_tensor.device, dtype=torch.float32)
