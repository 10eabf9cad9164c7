"""The reward hub: built-in scorers chosen by NAME (slime's `--rm-type`), and group scoring for the rollout driver.

Two ways pick a scorer, as in verl and slime:
  - by the sample's `data_source` (verl): `scorers.default_compute_score`, the default;
  - by name for every sample (slime's rm_type): `custom_reward_function.rm_type`, one of NAMED_SCORERS —
      math         last \\boxed{} vs the ground truth (MATH normalisation; math-verify's proof when installed)
      math_verify  the same, requiring math-verify (validation refuses it when the package is missing)
      dapo         DAPO's "Answer:" scorer, +1 / -1 (verl's math_dapo)
      deepscaler   DeepScaleR's: the boxed answer after </think>, 1 / 0
      f1           token F1 for short answers
      gsm8k        "#### <number>"
      remote_rm    a reward model over HTTP (custom_reward_function.remote_rm: url, timeout, retries)
    A "boxed_" prefix (slime's) scores the content of the response's last \\boxed{} instead of the response
    ("boxed_f1"). A row's own `extra_info["rm_type"]` (slime's per-sample metadata) wins over the run's
    rm_type and the data_source dispatch, not over a user's function; the hub reads it where it scores (the
    reward managers with rm_type set, and `score_group` always).

`build_compute_score(config)` gives the reward managers their scoring function (per sample, or over lists for
reward_model.reward_manager=batch, where a remote reward model scores a batch concurrently).
With the naive and dapo managers a remote reward model is asked one sample after the other; the batch manager
(and score_group) ask for all samples at once. As for any mix of scorers in one batch, rows whose scorers
return different extra keys (dapo's acc/pred next to f1's plain float) cannot share a batch in the reward
managers (base.py refuses it); score_group has no such limit.

`score_group(samples, hub)` is the asynchronous entry point for a rollout driver that scores each group of
samples as soon as it finishes, overlapping scoring with the generation still running.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from hybridrl.reward.custom_function import load_user_reward_fn
from hybridrl.reward.remote_rm import RemoteRewardModel, make_payload
from hybridrl.reward.scorers import deepscaler, default_compute_score, f1, gsm8k, math_dapo
from hybridrl.reward.scorers import math as math_scorer

logger = logging.getLogger(__name__)

REMOTE = "remote_rm"
BOXED_PREFIX = "boxed_"


def _math(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return math_scorer._score_math_sample(data_source, solution_str, str(ground_truth), extra_info)


def _math_verify(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return math_scorer.compute_score_math_verify(solution_str, str(ground_truth))


def _gsm8k(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return gsm8k.compute_score(solution_str, str(ground_truth))


# name -> scorer with verl's signature (data_source, solution_str, ground_truth, extra_info) -> float | dict
NAMED_SCORERS: dict[str, Callable] = {
    "math": _math,
    "math_verify": _math_verify,
    "dapo": math_dapo.score_dapo_sample,
    "deepscaler": deepscaler.score_deepscaler_sample,
    "f1": f1.score_f1_sample,
    "gsm8k": _gsm8k,
}


def known_rm_types() -> list[str]:
    return sorted(NAMED_SCORERS) + [REMOTE]


def check_rm_type(rm_type: str) -> None:
    """Raise ValueError naming the known names when `rm_type` (after a "boxed_" prefix) is not one."""
    base = rm_type[len(BOXED_PREFIX):] if rm_type.startswith(BOXED_PREFIX) else rm_type
    if base not in NAMED_SCORERS and base != REMOTE:
        raise ValueError(f"unknown rm_type {rm_type!r}; known: {known_rm_types()} (each also with a "
                         f"{BOXED_PREFIX!r} prefix)")


def boxed_content(response: str) -> str:
    """The content of the response's last \\boxed{} ("" when there is none)."""
    boxed = math_scorer.last_boxed_only_string(response)
    return math_scorer.remove_boxed(boxed) if boxed is not None else ""


@dataclass
class RewardInput:
    """One sample as a scorer sees it. `prompt` is the decoded prompt when the caller has it (the remote
    reward model receives it); `extra_info` may hold `rm_type` to choose this sample's scorer."""
    response: str
    label: Any
    data_source: str = ""
    extra_info: Optional[dict] = None
    prompt: Optional[str] = None


@dataclass
class SampleScore:
    """A scored sample: `reward` is the float trained on; `extra` the scorer's other dict keys; `error` says why
    scoring failed (reward is then 0.0), None when it did not."""
    reward: float
    extra: dict = field(default_factory=dict)
    error: Optional[str] = None


class RewardHub:
    """The scorer a run selected: a named one (`rm_type`), the user's function, or the data_source dispatch.

    custom_fn: custom_reward_function.path/name (sync or async; per sample). rm_type: a NAMED_SCORERS name,
    remote_rm, or either with the boxed_ prefix. remote: the reward model for remote_rm."""

    def __init__(self, rm_type: Optional[str] = None, custom_fn: Optional[Callable] = None,
                 remote: Optional[RemoteRewardModel] = None, score_timeout: Optional[float] = None):
        if rm_type is not None:
            check_rm_type(rm_type)
        if rm_type is not None and custom_fn is not None:
            raise ValueError("set custom_reward_function.rm_type or custom_reward_function.path, not both")
        self.rm_type, self.custom_fn, self.remote = rm_type, custom_fn, remote
        self.score_timeout = score_timeout  # seconds a rule scorer may take in score_async (None: no limit)

    @classmethod
    def from_config(cls, config) -> "RewardHub":
        """From the run config's custom_reward_function (path/name, rm_type, remote_rm). The remote reward
        model exists whenever remote_rm.url is set, so rows may ask for it by their own rm_type."""
        custom = config.custom_reward_function
        remote = RemoteRewardModel.from_config(custom.remote_rm) if custom.remote_rm.url else None
        return cls(rm_type=custom.rm_type, custom_fn=load_user_reward_fn(config), remote=remote,
                   score_timeout=config.reward_model.score_timeout)

    def _rm_type_of(self, extra_info: Optional[dict]) -> Optional[str]:
        """The row's own rm_type, else the run's; a user's function (custom_reward_function.path) scores every
        row itself (as slime's custom_rm_path wins over the metadata)."""
        if self.custom_fn is not None:
            return None
        row_type = extra_info.get("rm_type") if isinstance(extra_info, dict) else None
        if row_type:
            check_rm_type(str(row_type))
        return str(row_type) if row_type else self.rm_type

    def _prepared(self, sample: RewardInput) -> tuple[Optional[str], RewardInput]:
        """This sample's scorer name without the boxed_ prefix, and the sample (its response unboxed for it)."""
        rm_type = self._rm_type_of(sample.extra_info)
        if rm_type is not None and rm_type.startswith(BOXED_PREFIX):
            rm_type = rm_type[len(BOXED_PREFIX):]
            sample = RewardInput(boxed_content(sample.response), sample.label, sample.data_source,
                                 sample.extra_info, sample.prompt)
        return rm_type, sample

    def score_blocking(self, sample: RewardInput) -> "float | dict":
        """One sample, synchronously (a reward manager's call); raises when the scorer fails."""
        rm_type, sample = self._prepared(sample)
        if rm_type == REMOTE:
            return self._remote().score_one_blocking(_payload(sample))
        result = self._sync_scorer(rm_type)(sample.data_source, sample.response, sample.label, sample.extra_info)
        if inspect.isawaitable(result):  # a user's async scorer called from synchronous code
            return asyncio.run(_awaited(result))
        return result

    async def score_async(self, sample: RewardInput, session=None) -> "float | dict":
        """One sample from async code: remote requests are awaited, rule scorers run on a thread (so the
        event loop keeps serving generation), an async user function is awaited. A rule scorer or async function
        still busy after `score_timeout` seconds raises TimeoutError (its thread cannot be stopped; it is left)."""
        rm_type, sample = self._prepared(sample)
        if rm_type == REMOTE:
            if session is None:
                async with self._remote().session() as own_session:
                    return await self._remote().score(own_session, _payload(sample))
            return await self._remote().score(session, _payload(sample))
        scorer = self._sync_scorer(rm_type)
        arguments = (sample.data_source, sample.response, sample.label, sample.extra_info)
        if inspect.iscoroutinefunction(scorer):
            return await asyncio.wait_for(scorer(*arguments), self.score_timeout)
        return await asyncio.wait_for(asyncio.to_thread(scorer, *arguments), self.score_timeout)

    def _sync_scorer(self, rm_type: Optional[str]) -> Callable:
        if rm_type is not None:
            return NAMED_SCORERS[rm_type]
        return self.custom_fn or default_compute_score

    def _remote(self) -> RemoteRewardModel:
        if self.remote is None:
            raise ValueError("a sample asks for rm_type=remote_rm but custom_reward_function.remote_rm.url is not set")
        return self.remote

    def uses_remote(self) -> bool:
        return self.remote is not None

    # ---- the reward managers' scoring functions
    def per_sample_fn(self) -> Callable:
        """verl's per-sample compute_score(data_source, solution_str, ground_truth, extra_info)."""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return self.score_blocking(RewardInput(solution_str, ground_truth, data_source, extra_info))
        compute_score.__qualname__ = f"reward hub ({self.rm_type})"
        return compute_score

    def batch_fn(self) -> Callable:
        """The batch manager's compute_score(data_sources, solution_strs, ground_truths, extra_infos): every
        sample at once, concurrently; a failed sample comes back as its ScorerFailure (the others keep theirs)."""
        from hybridrl.reward.managers.base import ScorerFailure

        def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
            samples = [RewardInput(*row) for row in zip(solution_strs, ground_truths, data_sources, extra_infos)]
            results = asyncio.run(self._score_all(samples))
            for result in results:
                if isinstance(result, Exception):
                    logger.warning("reward hub: a sample failed (%s); it scores 0 and counts in reward/errors", result)
            return [ScorerFailure(result) if isinstance(result, Exception) else result for result in results]
        compute_score.__qualname__ = f"reward hub ({self.rm_type}, batch)"
        return compute_score

    async def _score_all(self, samples: Sequence[RewardInput]) -> list:
        """Every sample's result or its exception, concurrently (one HTTP session for the remote ones)."""
        if self.remote is None:
            return await asyncio.gather(*(self.score_async(sample) for sample in samples), return_exceptions=True)
        async with self.remote.session() as session:
            return await asyncio.gather(*(self.score_async(sample, session) for sample in samples),
                                        return_exceptions=True)


async def score_group(samples: Sequence[RewardInput], hub: RewardHub) -> list[SampleScore]:
    """Score one finished group of samples (e.g. the n responses of one prompt), concurrently; one SampleScore
    per sample, in order.

    Call it from the rollout driver's event loop as soon as a group's last sample is done, so scoring overlaps
    the generation of the other groups. It never raises for a sample: a scorer that raises, or returns no
    finite number, or a remote reward model that times out after its retries, or a scorer busy for longer than
    reward_model.score_timeout gives that sample reward 0.0 with `error` set (count them into the
    `reward/errors` metric). So it returns within the remote reward model's `worst_case_seconds()` for remote_rm
    and within score_timeout otherwise; rule scorers run on worker threads. The hub: `RewardHub.from_config`.
    """
    from hybridrl.reward.managers.base import invalid_score_problem

    results = await hub._score_all(samples)
    scored = []
    for sample, result in zip(samples, results):
        if isinstance(result, Exception):
            scored.append(SampleScore(0.0, error=f"{type(result).__name__}: {result}"))
            continue
        score = result.get("score") if isinstance(result, dict) else result
        problem = "a dict without 'score'" if score is None else invalid_score_problem(score)
        if problem is not None:
            scored.append(SampleScore(0.0, error=f"the scorer returned {problem} for data_source "
                                                 f"{sample.data_source!r}"))
            continue
        extra = {key: value for key, value in result.items() if key != "score"} if isinstance(result, dict) else {}
        scored.append(SampleScore(float(score), extra))
    return scored


def _payload(sample: RewardInput) -> dict:
    return make_payload(sample.response, sample.label, sample.data_source, sample.extra_info, sample.prompt)


async def _awaited(awaitable):
    return await awaitable
