"""The engine server of `rollout.mode=async` and of the data flow in any mode (data/config_checks.py,
engine_servers_switch): each rollout replica (actor-rollout worker rank) answers single generate requests over HTTP
while the controller's agent loops send them.

Why HTTP on the node's address rather than Ray actor calls: the worker is a synchronous Ray actor
(one method at a time). An engine must take many requests at once to batch them, while the worker's
own Ray thread stays free for the controller's calls (rollout_mode / trainer_mode). A small aiohttp
server on its own event loop gives that without touching the worker's Ray concurrency, is what
verl's and SGLang's servers are (so an external engine server slots in), and a worker that dies
closes its socket: the client sees the refused or dropped connection at once, with no timeout to tune.

The server serves only in rollout mode. `serve()` (called by the worker's rollout_mode, once the
engine holds the trainer's weights) opens the gate and runs its event loop in a thread; `pause()`
(trainer_mode) closes the gate, waits for the requests under way and stops the loop before the
weights move again. A request arriving in trainer mode waits (in the socket's backlog, or at the
gate) until the next rollout_mode: no request ever sees released or half-updated weights.

Engines (`AsyncEngine`: `async generate(prompt_ids, sampling_params) -> dict`):
- HFGenerateEngine: HF `generate` on the FSDP-held module (CPU and GPU), batching the requests
  that arrive together (sglang_async.py has SGLang's, vllm_async.py vLLM's).

Request (POST /generate, JSON): {"request_id", "prompt_ids": [int], "sampling_params": {temperature, top_p, top_k,
logprobs, max_tokens (default rollout.response_length), seed (rollout.full_determinism)}}. Temperature 0 = greedy.
Both ways the JSON is msgspec's: it took 0.015 s for 512 answers of 512 tokens and log-probs where the standard
library's took 0.13 s on a 2-core CPU, time the engine's event loop spends between answers
(benchmarks/engine_server_requests.py).
Answer: verl's TokenOutput as JSON {token_ids, log_probs, stop_reason} plus `weight_version`, the policy version
of the weights that generated it (training steps whose update produced them, batch_layout.py): the one source of
every per-token version the trainer sees (response_weight_versions); an engine error is an HTTP 500 whose body is
the error and its traceback.

Abort (POST /abort, partial rollout, data/ and trainer/ppo/group_rollout.py): every request under way stops at
its next token and answers with the tokens (and log-probs) it has so far and stop_reason "aborted"; requests
still queued, and any that arrive later, answer at once with no tokens and "aborted", until the next rollout
mode (`serve`) clears the abort. An engine without `abort` answers HTTP 501.
"""
from __future__ import annotations

import asyncio
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import msgspec
import torch
from aiohttp import web
from transformers import StoppingCriteria, StoppingCriteriaList

from hybridrl.models.fsdp_utils import hf_module
from hybridrl.algorithms.torch_functional import logprobs_from_logits
from hybridrl.workers.rollout.engine_io import aborted_answer, requested_max_tokens
from hybridrl.workers.rollout.request_seeds import seeded_generator

# Up to rollout.n x the batch of agent loops connect at once: at the start of a run, and at every step whose gap since
# the last one outlasted the clients' keep-alive (server_manager.py). A connection beyond the listen queue is dropped
# and the client's kernel tries again only after a second: with aiohttp's default queue of 128, 512 requests from 8
# clients lost 36-147 connections a run that way, and their last answer came 1.14 s after the start instead of 0.24 s
# (2-core CPU, medians of 7 runs, benchmarks/engine_server_requests.py). The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 4096
KEEPALIVE_S = 75.0  # how long an idle connection stays open here (aiohttp's default); clients close theirs sooner

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "logprobs", "max_tokens", "max_new_tokens", "repetition_penalty",
                 "seed"}  # seed: rollout.full_determinism's per-request seed (rollout/request_seeds.py)


class AsyncEngine(Protocol):
    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]: ...


class EngineServer:
    """An aiohttp server for one engine, on `loop` (a fresh one by default; SGLang passes its engine's loop)."""

    def __init__(self, engine: AsyncEngine, host: str, loop: Optional[asyncio.AbstractEventLoop] = None):
        self.engine = engine
        self._own_loop = loop is None  # closed at shutdown (SGLang's loop stays its engine's)
        self.loop = loop or asyncio.new_event_loop()
        self._thread: Optional[threading.Thread] = None
        self._in_flight = 0
        self._served_at, self._admitted = 0.0, []  # this serving window's start and request admission times
        self.weight_version: Optional[int] = None  # the policy version the engine holds while serving
        # Set only in rollout mode. SGLang's loop also runs in trainer mode, whenever the worker drives the engine
        # (run_until_complete of a release, a resume): a request accepted then waits here, not at the engine.
        self._open = asyncio.Event()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([web.post("/generate", self._generate), web.post("/abort", self._abort),
                        web.post("/reset_abort", self._reset_abort), web.get("/health", self._health)])
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,  # no log line per request
                                     keepalive_timeout=KEEPALIVE_S)
        self.loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, host, 0, backlog=LISTEN_BACKLOG)
        self.loop.run_until_complete(site.start())
        port = self._runner.addresses[0][1]
        self.address = f"{host}:{port}"

    def serve(self, weight_version: Optional[int] = None) -> None:
        """Start answering requests (rollout mode) with the weights of `weight_version` (reported in every answer)."""
        if self._thread is not None:
            return
        reset_abort = getattr(self.engine, "reset_abort", None)
        if reset_abort is not None:  # an abort lasts until the next rollout mode
            reset_abort()
        self.weight_version = weight_version
        self._served_at, self._admitted = time.monotonic(), []
        self._open.set()  # the loop is not running: no other thread touches it now
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-server", daemon=True)
        self._thread.start()

    def pause(self) -> dict[str, float]:
        """Stop answering (trainer mode): requests wait in the backlog; ones being generated finish first. Returns the
        serving window's metrics (window_metrics; {} when it was not serving)."""
        if self._thread is None:
            return {}
        asyncio.run_coroutine_threadsafe(self._close_and_drain(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self._thread = None
        return window_metrics(self._served_at, self._admitted)

    def shutdown(self) -> None:
        self.pause()
        close = getattr(self.engine, "close", None)
        if close is not None:
            self.loop.run_until_complete(close())
        self.loop.run_until_complete(self._runner.cleanup())
        if self._own_loop:
            self.loop.close()

    async def _close_and_drain(self) -> None:
        self._open.clear()
        while self._in_flight:
            await asyncio.sleep(0.01)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _abort(self, request: web.Request) -> web.Response:
        abort = getattr(self.engine, "abort", None)
        if abort is None:
            return web.Response(status=501, text=f"engine server {self.address}: {type(self.engine).__name__} "
                                                 f"cannot abort requests")
        aborted = await abort()
        return web.json_response({"aborted": aborted})

    async def _reset_abort(self, request: web.Request) -> web.Response:
        """New requests generate again (after an abort, once its aborted requests are all answered: the data flow's
        stragglers collected, so that a generation started before the next rollout mode, one-step-off's next
        batch, is not answered aborted)."""
        reset_abort = getattr(self.engine, "reset_abort", None)
        if reset_abort is not None:
            reset_abort()
        return web.json_response({"ok": True})

    async def _generate(self, request: web.Request) -> web.Response:
        try:
            payload = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as err:
            return web.Response(status=400, text=f"engine server {self.address}: the request is not JSON: {err}")
        await self._open.wait()
        self._admitted.append(time.monotonic())
        self._in_flight += 1
        try:
            unknown = set(payload.get("sampling_params", {})) - SAMPLING_KEYS
            if unknown:
                raise ValueError(f"unknown sampling_params {sorted(unknown)}; known: {sorted(SAMPLING_KEYS)}")
            result = await self.engine.generate(list(payload["prompt_ids"]), dict(payload["sampling_params"]))
            result["weight_version"] = self.weight_version
        except Exception:  # the client turns this into EngineServerError, which fails the step
            return web.Response(status=500, text=f"engine server {self.address}: {traceback.format_exc()}")
        finally:
            self._in_flight -= 1
        return web.Response(body=msgspec.json.encode(result), content_type="application/json")


WINDOW_METRICS = ("rollout/server_requests", "timing_s/server_first_request", "timing_s/server_last_request")


def window_metrics(served_at: float, admitted: list[float]) -> dict[str, float]:
    """What one serving window (serve() to pause()) saw: rollout/server_requests, the requests it admitted, and
    timing_s/server_first_request / timing_s/server_last_request, the seconds from serve() to the first and the last
    of them. Their difference is how long the clients took to send all their requests: an engine reaches its full
    batch only then (agent loops that send slowly leave it decoding small batches, issue 26)."""
    if not admitted:
        return {WINDOW_METRICS[0]: 0.0}
    return dict(zip(WINDOW_METRICS, (float(len(admitted)), min(admitted) - served_at, max(admitted) - served_at)))


# ---------------------------------------------------------------------- HF generate, batched

@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    future: asyncio.Future = field(repr=False)
    logprobs: bool = False


class HFGenerateEngine:
    """HF `generate` on the rollout's FSDP-held module, batching the requests that wait together.

    Requests queue; a batcher takes everything queued with the same sampling parameters (up to
    `max_batch_size`) into one left-padded `generate` call, run in one executor thread (the module
    runs one batch at a time), while new requests queue for the next batch. Each row is cut at its
    first EOS (kept) and at its own max_tokens. Sampling matches the sync hf rollout: temperature /
    top_p / top_k (-1 off), greedy at temperature 0, repetition penalty pinned to 1; log-probs under
    logits / temperature (raw logits when greedy). A request with a `seed` (rollout.full_determinism) is generated
    alone from a generator of that seed: HF draws a batch's rows from one generator, so a row's tokens would
    depend on the requests that happened to arrive with it.
    """

    def __init__(self, module, response_length: int, eos_token_ids: list[int], pad_token_id: int,
                 max_batch_size: int):
        self.module = module
        self.response_length = response_length
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self._queues: dict[tuple, list[_Request]] = {}
        self._wake: Optional[asyncio.Event] = None
        self._batcher: Optional[asyncio.Task] = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")
        self.batch_sizes: list[int] = []  # rows of each generate call (tests check that requests were batched)
        # Set by abort (on the server's loop), read by the generate thread's stopping criterion at every token.
        self._aborting = threading.Event()

    async def abort(self) -> int:
        """Stop the batch being generated at its next token and answer every queued request as aborted; later
        requests too, until reset_abort. Returns how many queued requests were answered here."""
        self._aborting.set()
        queued = [request for requests in self._queues.values() for request in requests]
        self._queues.clear()
        for request in queued:
            if not request.future.done():
                request.future.set_result(aborted_answer(request.logprobs))
        return len(queued)

    def reset_abort(self) -> None:
        self._aborting.clear()

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty")
        max_tokens = requested_max_tokens(sampling_params, self.response_length, "hf")
        key = _sampling_key(sampling_params)
        if self._aborting.is_set():
            return aborted_answer(bool(sampling_params.get("logprobs", False)))
        if self._batcher is None or self._batcher.done():
            self._wake = asyncio.Event()
            self._batcher = asyncio.get_running_loop().create_task(self._run_batches())
        future = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, []).append(_Request(prompt_ids, max_tokens, future,
                                                         bool(sampling_params.get("logprobs", False))))
        self._wake.set()
        return await future

    async def _run_batches(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0.005)  # let requests sent together arrive together
            while self._queues:
                key = next(iter(self._queues))
                queued = self._queues[key]
                batch, self._queues[key] = queued[:self.max_batch_size], queued[self.max_batch_size:]
                if not self._queues[key]:
                    del self._queues[key]
                try:
                    results = await loop.run_in_executor(self._executor, self._generate_batch, batch, dict(key))
                except Exception as err:
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(err)
                    continue
                for request, result in zip(batch, results):
                    if not request.future.done():
                        request.future.set_result(result)

    async def close(self) -> None:
        """Stop the batcher (the server is shutting down)."""
        if self._batcher is not None and not self._batcher.done():
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
        self._executor.shutdown(wait=True)

    @torch.no_grad()
    def _generate_batch(self, batch: list[_Request], params: dict[str, Any]) -> list[dict[str, Any]]:
        model = hf_module(self.module)
        device = next(model.parameters()).device
        width = max(len(request.prompt_ids) for request in batch)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            input_ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            attention_mask[row, width - len(request.prompt_ids):] = 1
        temperature = float(params["temperature"])
        greedy = temperature == 0
        sampling = ({"do_sample": False, "temperature": None, "top_p": None, "top_k": None} if greedy else
                    {"do_sample": True, "temperature": temperature, "top_p": float(params["top_p"]),
                     "top_k": 0 if params["top_k"] == -1 else int(params["top_k"])})
        self.batch_sizes.append(len(batch))
        with seeded_generator(params["seed"], device):  # a seeded request is alone in its batch (_sampling_key)
            output = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                    max_new_tokens=max(request.max_tokens for request in batch),
                                    eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id,
                                    repetition_penalty=1.0, use_cache=True, return_dict_in_generate=True,
                                    # each rank's server runs its own batches: no collective per step (HF turns
                                    # one on for FSDP modules; FSDP2 in rollout mode holds every layer gathered)
                                    synced_gpus=False, output_logits=params["logprobs"],
                                    stopping_criteria=StoppingCriteriaList([_StopOnAbort(self._aborting)]),
                                    **sampling)
        generated = output.sequences[:, width:].cpu()
        log_probs = None
        if params["logprobs"]:
            logits = torch.stack(output.logits, dim=1).float().cpu() / (1.0 if greedy else temperature)
            log_probs = logprobs_from_logits(logits, generated)
        aborted = self._aborting.is_set()
        return [self._row_result(generated[row], None if log_probs is None else log_probs[row], request.max_tokens,
                                 aborted) for row, request in enumerate(batch)]

    def _row_result(self, tokens: torch.Tensor, log_probs: Optional[torch.Tensor], max_tokens: int,
                    aborted: bool = False) -> dict:
        token_ids = tokens[:max_tokens].tolist()
        # A row cut short by an abort has fewer than max_tokens and no EOS; HF pads rows that ended before
        # the batch did only after their EOS, so they still read as completed.
        stop_reason = "aborted" if aborted and len(token_ids) < max_tokens else "length"
        for position, token in enumerate(token_ids):
            if token in self.eos_token_ids:
                token_ids, stop_reason = token_ids[:position + 1], "completed"
                break
        return {"token_ids": token_ids, "stop_reason": stop_reason,
                "log_probs": None if log_probs is None else log_probs[:len(token_ids)].tolist()}


class _StopOnAbort(StoppingCriteria):
    """Ends HF generate at the next token once the engine is aborted (every row: the batch stops)."""

    def __init__(self, aborting: threading.Event):
        self.aborting = aborting

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.aborting.is_set(), dtype=torch.bool, device=input_ids.device)


def _sampling_key(params: dict[str, Any]) -> tuple:
    """The parameters a batch must share, normalised (hashable; the batch's max_tokens is the rows' max). Requests
    with different seeds never share one."""
    seed = params.get("seed")
    return (("temperature", float(params.get("temperature", 1.0))), ("top_p", float(params.get("top_p", 1.0))),
            ("top_k", int(params.get("top_k", -1))), ("logprobs", bool(params.get("logprobs", False))),
            ("seed", None if seed is None else int(seed)))


def build_engine_server(rollout, rollout_config, module, eos_token_ids: list[int], pad_token_id: int,
                        host: str) -> EngineServer | None:
    """The engine server for the worker's rollout engine (paused: serving starts in rollout mode). A tensor-parallel
    sglang engine spans its group's GPUs and lives in the group's first rank (tensor_parallel.py): that rank serves
    it, the others serve nothing (None). Their part in the lifecycle (resume, weight buckets, release) is unchanged."""
    from hybridrl.workers.rollout.tensor_parallel import TensorParallelRollout

    if isinstance(rollout, TensorParallelRollout):
        if not rollout.tp.is_leader:
            return None
        rollout = rollout.engine  # the leader's SGLangRollout
    if rollout_config.name == "sglang":
        from hybridrl.workers.rollout.sglang_async import SGLangAsyncEngine

        return EngineServer(SGLangAsyncEngine(rollout, eos_token_ids), host, loop=rollout.engine.loop)
    if rollout_config.name == "vllm":
        from hybridrl.workers.rollout.vllm_async import VLLMAsyncEngine

        return EngineServer(VLLMAsyncEngine(rollout, eos_token_ids), host)
    if rollout_config.name == "hf":
        engine = HFGenerateEngine(module, rollout_config.response_length, eos_token_ids, pad_token_id,
                                  max_batch_size=rollout_config.max_num_seqs)
        return EngineServer(engine, host)
    raise NotImplementedError(f"engine servers exist for rollout.name hf, sglang and vllm, "
                              f"got {rollout_config.name!r}")
