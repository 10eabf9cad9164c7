"""A reward model behind HTTP (slime's `remote_rm`): one POST per sample, bounded in time, retried, never hanging.

Each sample is sent as JSON

    {"prompt": str | null, "response": str, "label": ground truth, "data_source": str, "extra_info": dict | null}

(slime's payload — prompt, response, label — plus verl's scorer arguments) to `custom_reward_function.remote_rm.url`;
the server answers a number or a dict with "score" (more keys become per-sample extras, as for any scorer).
The prompt is known when the rollout driver scores through `score_group`; the reward managers score decoded
responses only (verl's scorer contract), so there it is null — put what the server needs in `extra_info` when
preparing the data (verl's preprocessors keep the question there).

A request gets `timeout` seconds. A timeout, a dropped connection, or a 5xx / 429 answer is retried up to
`max_retries` more times, after `retry_delay` seconds doubled each time; then `RemoteRewardError` is raised,
which costs that sample (0, counted in `reward/errors`), not the step. Any other 4xx answer or a reply that is
no score is not retried (asking again gets the same answer). So one sample takes at most
`worst_case_seconds()`; validation checks that this stays under `reward_model.score_timeout`.
"""
from __future__ import annotations

import asyncio
import json
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp

RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """The reward server gave no score for a sample (after the retries, where retrying made sense)."""


@dataclass
class RemoteRewardModel:
    url: str
    timeout: float
    max_retries: int
    retry_delay: float
    max_concurrency: int

    @classmethod
    def from_config(cls, remote_config) -> "RemoteRewardModel":
        """From `custom_reward_function.remote_rm` (url, timeout, max_retries, retry_delay, max_concurrency)."""
        if not remote_config.url:
            raise ValueError("custom_reward_function.rm_type=remote_rm needs custom_reward_function.remote_rm.url")
        return cls(url=remote_config.url, timeout=float(remote_config.timeout),
                   max_retries=int(remote_config.max_retries), retry_delay=float(remote_config.retry_delay),
                   max_concurrency=int(remote_config.max_concurrency))

    def worst_case_seconds(self) -> float:
        """The longest one sample can take: every attempt timing out, plus the waits between them."""
        waits = sum(self.retry_delay * 2 ** attempt for attempt in range(self.max_retries))
        return self.timeout * (self.max_retries + 1) + waits

    def session(self) -> aiohttp.ClientSession:
        """A client session for the running event loop (close it, e.g. `async with`)."""
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                     connector=aiohttp.TCPConnector(limit=self.max_concurrency))

    async def score(self, session: aiohttp.ClientSession, payload: dict) -> "float | dict":
        """The server's score for one sample; RemoteRewardError when it gives none (see the module docstring)."""
        last_problem = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.retry_delay * 2 ** (attempt - 1))
            try:
                async with session.post(self.url, json=payload) as response:
                    body = await response.text()
                    if response.status in RETRIED_STATUSES:
                        last_problem = f"HTTP {response.status}: {body[:200]}"
                        continue
                    if response.status >= 400:
                        raise RemoteRewardError(f"reward server {self.url} answered HTTP {response.status} (not "
                                                f"retried): {body[:200]}")
                    return parse_score(body, self.url)
            except (asyncio.TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
                last_problem = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise RemoteRewardError(f"reward server {self.url} gave no score after {self.max_retries + 1} attempt(s) "
                                f"(timeout {self.timeout:g} s each); last: {last_problem}")

    async def score_many(self, payloads: list[dict]) -> list:
        """One result per payload, concurrently (at most max_concurrency requests at once): a score, or the
        RemoteRewardError of that sample (returned, not raised, so one bad sample does not cost the others)."""
        async with self.session() as session:
            return await asyncio.gather(*(self.score(session, payload) for payload in payloads),
                                        return_exceptions=True)

    def score_one_blocking(self, payload: dict) -> "float | dict":
        """`score` from synchronous code (a reward manager's per-sample call): its own loop and session."""
        async def one():
            async with self.session() as session:
                return await self.score(session, payload)
        return asyncio.run(one())


def make_payload(response: str, label: Any, data_source: Any = None, extra_info: Optional[dict] = None,
                 prompt: Optional[str] = None) -> dict:
    return {"prompt": prompt, "response": response, "label": _jsonable(label), "data_source": data_source,
            "extra_info": _jsonable(extra_info)}


def parse_score(body: str, url: str) -> "float | dict":
    """A JSON number, or a JSON object with a finite "score"; anything else is a RemoteRewardError."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        raise RemoteRewardError(f"reward server {url} answered no JSON: {body[:200]!r}") from error
    score = value.get("score") if isinstance(value, dict) else value
    if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
        raise RemoteRewardError(f"reward server {url} answered {body[:200]!r}: expected a finite number or an "
                                "object with a finite 'score'")
    return value if isinstance(value, dict) else float(value)


def _jsonable(value: Any) -> Any:
    """numpy arrays and scalars (parquet columns arrive as them) as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    return value
