"""vLLM behind the engine server (async_server.EngineServer) in `rollout.mode=async`.

The engine is the worker's own in-process vLLM engine (vllm_rollout.py: hybrid engine, weights pushed
from FSDP by the rollout mode switch, sleep/wake-up by the lifecycle calls). vLLM's AsyncLLM would run
its engine core in another process, out of reach of the in-place weight load and of the sleep
bookkeeping, so the server drives the same engine's `LLMEngine` instead: every request is
`add_request`ed, and one stepping task on the server's loop calls `step()` while requests are
pending, resolving each request's future when its output is finished. Requests that arrive together
are batched by vLLM's scheduler (continuous batching, prefix cache) exactly as in `LLM.generate`.
A step blocks the loop for one engine iteration; handlers get their turn between steps.

The server serves only between rollout_mode and trainer_mode, and pause() drains the requests
under way before trainer_mode puts the engine to sleep, so the stepping task never runs on a
sleeping engine (it ends when nothing is pending).

Sampling mirrors vllm_rollout.sampling_params: every parameter explicit, greedy at temperature 0,
stop at the trainer's EOS ids unless `rollout.ignore_eos` (then at none: vllm_rollout.stop_token_ids); log-probs of
the sampled tokens with logprobs=0.

Abort (partial rollout): every pending request is aborted in the engine and answered with the tokens
(and log-probs) of its last step, stop_reason "aborted"; until the next rollout mode (`reset_abort`)
new requests answer at once with no tokens.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any

from hybridrl.workers.rollout.engine_io import EngineDiedError, aborted_answer, requested_max_tokens
from hybridrl.workers.rollout.vllm_rollout import ALL_MEMORY_TAGS, sampled_log_probs, vllm_sampling

STOP_REASONS = {"length": "length", "abort": "aborted"}  # vLLM finish_reason -> verl's stop_reason ("completed" else)


class VLLMAsyncEngine:
    def __init__(self, rollout, eos_token_ids: list[int]):
        """rollout: the worker's VLLMRollout (its engine, config and failure record)."""
        self.rollout = rollout
        self.eos_token_ids = list(eos_token_ids)
        self.aborting = False
        self._request_ids = itertools.count()
        self._pending: dict[str, asyncio.Future] = {}
        self._latest: dict[str, Any] = {}  # request id -> its last RequestOutput (cumulative): the answer on abort
        self._stepper: asyncio.Task | None = None

    @property
    def engine(self):
        return self.rollout.llm.llm_engine

    def sampling_params(self, params: dict[str, Any]) -> dict[str, Any]:
        config = self.rollout.config
        sampling = vllm_sampling(config, max_tokens=requested_max_tokens(params, config.response_length, "vllm"),
                                 eos_ids=self.eos_token_ids, log_probs=bool(params.get("logprobs", False)),
                                 temperature=float(params.get("temperature", 1.0)), top_p=params.get("top_p", 1.0),
                                 top_k=params.get("top_k", -1))
        if params.get("seed") is not None:  # rollout.full_determinism's per-request seed
            sampling["seed"] = int(params["seed"])
        return sampling

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        rollout = self.rollout
        if rollout.dead_cause is not None:
            raise EngineDiedError(f"vllm engine: {rollout.dead_cause}")
        if rollout.awake_tags != set(ALL_MEMORY_TAGS) or rollout.weights_stale:
            raise RuntimeError(f"generate: the vllm engine is asleep or has no weights (awake: "
                               f"{sorted(rollout.awake_tags)}, weights pushed: {not rollout.weights_stale}); the "
                               f"server answers only in rollout mode")
        logprobs = bool(sampling_params.get("logprobs", False))
        if self.aborting:
            return aborted_answer(logprobs)
        params = rollout.vllm.SamplingParams(**self.sampling_params(sampling_params))
        request_id = f"hybridrl-{next(self._request_ids)}"
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            rollout._call("add_request", self.engine.add_request, request_id,
                          {"prompt_token_ids": list(prompt_ids)}, params)
        except Exception:
            self._pending.pop(request_id, None)
            raise
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._step_while_pending())
        output, aborted = await future
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        stop_reason = "aborted" if aborted else STOP_REASONS.get(completion.finish_reason, "completed")
        log_probs = sampled_log_probs(completion, 0) if logprobs else None
        return {"token_ids": token_ids, "stop_reason": stop_reason, "log_probs": log_probs}

    async def _step_while_pending(self) -> None:
        """Step the engine while requests are pending; a failing step fails every pending request with its error."""
        while self._pending:
            try:
                outputs = self.rollout._call("step", self.engine.step)
            except Exception as error:
                for future in self._pending.values():
                    if not future.done():
                        future.set_exception(error)
                self._pending.clear()
                self._latest.clear()
                return
            for output in outputs:
                if output.request_id not in self._pending:
                    continue
                self._latest[output.request_id] = output
                if output.finished:
                    self._resolve(output.request_id, output, aborted=False)
            await asyncio.sleep(0)  # let the server's handlers add requests between steps

    def _resolve(self, request_id: str, output, aborted: bool) -> None:
        future = self._pending.pop(request_id)
        self._latest.pop(request_id, None)
        if not future.done():
            future.set_result((output, aborted))

    async def abort(self) -> int:
        """Abort every pending request; each answers with the tokens of its last step."""
        self.aborting = True
        request_ids = list(self._pending)
        if request_ids:
            self.rollout._call("abort_request", self.engine.abort_request, request_ids)
        for request_id in request_ids:
            latest = self._latest.get(request_id)
            if latest is None:  # not stepped yet: no tokens
                self._pending[request_id].set_result((_EmptyOutput(), True))
                self._pending.pop(request_id)
            else:
                self._resolve(request_id, latest, aborted=True)
        return len(request_ids)

    def reset_abort(self) -> None:
        self.aborting = False


class _EmptyOutput:
    """A RequestOutput stand-in for a request aborted before its first step: no tokens, no log-probs."""

    class _Completion:
        token_ids: list[int] = []
        logprobs: list = []
        finish_reason = "abort"

    outputs = [_Completion()]
