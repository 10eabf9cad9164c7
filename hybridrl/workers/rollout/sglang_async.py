"""SGLang's async engine behind the engine server (async_server.EngineServer) in `rollout.mode=async`.

The sglang.Engine already lives in the worker process (sglang_rollout.py: hybrid engine, weights
pushed from FSDP by the rollout mode switch). Its tokenizer manager and response loop are bound to
the engine's own asyncio loop (`engine.loop`, where EngineMonitor starts the response loop), and the
worker drives that loop with run_until_complete for every lifecycle call (resume, weight update,
release). So the server runs on that same loop: `EngineServer(engine, host, loop=engine.loop)`.
Between rollout_mode and trainer_mode the server's thread runs the loop and requests call
`engine.async_generate` there, batched by SGLang's scheduler (continuous batching, radix prefix cache);
outside it the worker's thread owns the loop again. The two never run the loop at once because
rollout_mode starts serving only after its lifecycle calls and trainer_mode stops serving before its.

Admission: the requests that reach the server in one event-loop iteration go to SGLang's scheduler as one batch
(admission.py, _admit), each still answered when its own generation ends; `batch_admission = False` sends each through
Engine.async_generate on its own, the baseline benchmarks/agent_loop_gap.py measures beside it.

Sampling mirrors sglang_rollout.sampling_params: every parameter explicit, greedy at temperature 0,
stop at the trainer's EOS ids (stop token kept), `rollout.ignore_eos`; log-probs are SGLang's
output_token_logprobs (under logits / temperature, as the actor scores them).

Abort (partial rollout): `abort` asks SGLang's tokenizer manager to abort every request (abort_all), on the
engine's loop where the server's handlers run; SGLang answers each with the tokens it has so far and
finish_reason "abort", passed on as stop_reason "aborted". Until the next rollout mode (`reset_abort`) new requests
answer at once with no tokens, so an agent loop's next turn cannot start generating again.
"""
from __future__ import annotations

import asyncio
from typing import Any

from hybridrl.workers.rollout.admission import AdmissionBatcher, answer, fail
from hybridrl.workers.rollout.engine_io import EngineDiedError, aborted_answer, requested_max_tokens
from hybridrl.workers.rollout.sglang_rollout import ALL_MEMORY_TAGS


class SGLangAsyncEngine:
    def __init__(self, rollout, eos_token_ids: list[int]):
        """rollout: the worker's SGLangRollout (its engine, config and EngineMonitor)."""
        self.rollout = rollout
        self.eos_token_ids = list(eos_token_ids)
        self.aborting = False
        # Requests that reach the server together go to SGLang as one batch (admission.py); False sends each one
        # through Engine.async_generate on its own (agent_loop_gap.py measures the two).
        self.batch_admission = True
        self.batcher = AdmissionBatcher(self._admit)

    async def abort(self) -> int:
        self.aborting = True
        self.rollout.engine.tokenizer_manager.abort_request(abort_all=True)
        return 0

    def reset_abort(self) -> None:
        self.aborting = False

    def sampling_params(self, params: dict[str, Any]) -> dict[str, Any]:
        config = self.rollout.config
        max_tokens = requested_max_tokens(params, config.response_length, "sglang")
        base = {"max_new_tokens": max_tokens, "ignore_eos": config.ignore_eos, "stop_token_ids": self.eos_token_ids,
                "min_p": 0.0, "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
        if params.get("seed") is not None:  # rollout.full_determinism's per-request seed
            base["sampling_seed"] = int(params["seed"])
        temperature = float(params.get("temperature", 1.0))
        if temperature == 0:
            return {**base, "temperature": 0.0, "top_p": 1.0, "top_k": -1}
        return {**base, "temperature": temperature, "top_p": float(params.get("top_p", 1.0)),
                "top_k": int(params.get("top_k", -1))}

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        monitor = self.rollout.monitor
        if monitor.cause is not None:
            raise EngineDiedError(f"sglang engine: {monitor.cause}")
        if self.rollout.awake_tags != set(ALL_MEMORY_TAGS):
            raise RuntimeError(f"generate: the sglang engine's memory is released (awake: "
                               f"{sorted(self.rollout.awake_tags)}); the server answers only in rollout mode")
        logprobs = bool(sampling_params.get("logprobs", False))
        if self.aborting:
            return aborted_answer(logprobs)
        request = (list(prompt_ids), self.sampling_params(sampling_params), logprobs)
        try:
            if self.batch_admission:
                output = await self.batcher.submit(request)
            else:
                output = await self.rollout.engine.async_generate(input_ids=request[0], sampling_params=request[1],
                                                                  return_logprob=logprobs)
        except asyncio.CancelledError as cancelled:  # EngineMonitor cancels the loop's tasks when a child dies
            if monitor.cause is not None:
                raise EngineDiedError(f"sglang engine: {monitor.cause}") from cancelled
            raise
        if output is None:  # admitted after an abort: never sent to the engine
            return aborted_answer(logprobs)
        meta = output["meta_info"]
        finish = meta.get("finish_reason") or {}
        if finish.get("type") == "abort" and not self.aborting:
            raise RuntimeError(f"sglang aborted the request: {finish.get('message', finish)}")
        token_ids = list(output["output_ids"])
        stop_reason = {"length": "length", "abort": "aborted"}.get(finish.get("type"), "completed")
        log_probs = [entry[0] for entry in meta.get("output_token_logprobs") or []] if logprobs else None
        if log_probs is not None and len(log_probs) != len(token_ids):
            raise RuntimeError(f"sglang returned {len(token_ids)} tokens but {len(log_probs)} log-probs "
                               f"(finish_reason {finish})")
        return {"token_ids": token_ids, "stop_reason": stop_reason, "log_probs": log_probs}

    async def _admit(self, requests: list[tuple], futures: list[asyncio.Future]) -> None:
        """The requests of one admission batch to SGLang's scheduler as one message, each answered as its own
        generation ends: what SGLang's TokenizerManager.generate_request does for a batch of token ids
        (_handle_batch_request), except that it answers a non-streamed batch only once all of it has finished.
        Requests admitted after an abort are answered None (aborted) without reaching the engine."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        if self.aborting:
            for future in futures:
                answer(future, None)
            return
        manager = self.rollout.engine.tokenizer_manager
        batch = GenerateReqInput(input_ids=[prompt for prompt, _, _ in requests],
                                 sampling_params=[params for _, params, _ in requests],
                                 return_logprob=[logprobs for _, _, logprobs in requests])
        manager.auto_create_handle_loop()
        batch.normalize_batch_and_arguments()
        manager._init_req_state(batch)
        try:
            async with manager.is_pause_cond:
                await manager.is_pause_cond.wait_for(lambda: not manager.is_pause)
            async with manager.model_update_lock.reader_lock:  # a weight update waits for these generations
                members = [batch[index] for index in range(len(requests))]
                manager._send_batch_request([await manager._tokenize_one_request(member) for member in members])
                await asyncio.gather(*(self._answer_one(manager._wait_one_response(member), future)
                                       for member, future in zip(members, futures)))
        except BaseException:
            manager._discard_pending_req_states(batch)  # the ones never answered; SGLang does the same
            raise

    @staticmethod
    async def _answer_one(responses, future: asyncio.Future) -> None:
        try:
            answer(future, await anext(responses))
        except Exception as err:  # this request's error is its own; the batch's others still get their answers
            fail(future, err)
