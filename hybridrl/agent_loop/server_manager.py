"""AsyncLLMServerManager: which engine server gets a request, and the HTTP call to it.

Balancing: a new request id goes to the server with the fewest requests in flight right now (ties:
the first listed); a request id seen before goes back to the server it went to (sticky, an LRU map
of `max_cache_size` ids), so a multi-turn conversation that reuses its request id hits the server
whose prefix cache already holds its earlier turns. verl counts requests ever assigned; counting
the ones in flight balances by the load the servers actually carry. With stable_routing
(rollout.full_determinism) a request id goes to the server its stable hash picks, the same in every run:
the load at the moment it is sent depends on timing.

Failures: any error of the server (HTTP 5xx with its message, a refused or dropped connection of a
dead worker) raises EngineServerError, which fails the step, never only the sample (see manager.py).
"""
from __future__ import annotations

import urllib.request
from collections import OrderedDict
from typing import Any, Optional

import aiohttp
import msgspec

from hybridrl.agent_loop.base import TokenOutput
from hybridrl.utils.determinism import stable_seed


JSON_HEADERS = {"Content-Type": "application/json"}
# An idle connection is kept this long for the next step's requests (aiohttp's default, 15 s, is shorter than a step
# of a larger model: all of them connected again every step). Below the servers' own KEEPALIVE_S (async_server.py),
# so the client never sends on a connection the server is closing.
KEEPALIVE_S = 60.0


class EngineServerError(RuntimeError):
    """An engine server failed or is unreachable: the step fails (an agent loop's own bug only costs its sample)."""


class AsyncLLMServerManager:
    def __init__(self, server_addresses: list[str], max_cache_size: int = 10000, connect_timeout_s: float = 30.0,
                 stable_routing: bool = False):
        """server_addresses: "host:port" of each replica's engine server, in rank order (errors name the rank).
        stable_routing: route by the request id alone (rollout.full_determinism), not by the load."""
        if not server_addresses:
            raise ValueError("AsyncLLMServerManager needs at least one server address")
        self.server_addresses = list(server_addresses)
        self.in_flight = {address: 0 for address in self.server_addresses}
        self.request_to_server: OrderedDict[str, str] = OrderedDict()
        self.max_cache_size = max_cache_size
        self.connect_timeout_s = connect_timeout_s
        self.stable_routing = stable_routing
        self._session: Optional[aiohttp.ClientSession] = None

    def choose_server(self, request_id: str) -> str:
        """The server this request id sticks to, else the least loaded one (remembered for the id's next turn)."""
        if request_id in self.request_to_server:
            self.request_to_server.move_to_end(request_id)
            return self.request_to_server[request_id]
        if self.stable_routing:
            return self.server_addresses[stable_seed(request_id) % len(self.server_addresses)]
        server = min(self.server_addresses, key=lambda address: self.in_flight[address])
        self.request_to_server[request_id] = server
        if len(self.request_to_server) > self.max_cache_size:
            self.request_to_server.popitem(last=False)
        return server

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Optional[list[Any]] = None, video_data: Optional[list[Any]] = None,
                       audio_data: Optional[list[Any]] = None, mm_processor_kwargs: Optional[dict[str, Any]] = None,
                       mm_processor_output: Optional[list[dict[str, Any]]] = None, priority: int = 0) -> TokenOutput:
        """The tokens one server generates after `prompt_ids` (verl's signature, every release of 2026). The models
        here are text-only: the media arguments must be None or empty (what verl's loops pass for text), and the
        servers answer requests in arrival order: priority must be 0 (verl's default)."""
        media = {"image_data": image_data, "video_data": video_data, "audio_data": audio_data,
                 "mm_processor_kwargs": mm_processor_kwargs, "mm_processor_output": mm_processor_output}
        given = sorted(name for name, value in media.items() if value)
        if given:
            raise NotImplementedError(f"server_manager.generate: {', '.join(given)} given, but the engines here "
                                      f"serve text-only models; multi-modal rollouts are not supported")
        if priority != 0:
            raise NotImplementedError(f"server_manager.generate: priority={priority!r}, but the engine servers here "
                                      f"answer requests in arrival order (only priority 0)")
        server = self.choose_server(request_id)
        self.in_flight[server] += 1
        try:
            body = await self._post(server, {"request_id": request_id, "prompt_ids": list(prompt_ids),
                                             "sampling_params": dict(sampling_params)})
        finally:
            self.in_flight[server] -= 1
        return TokenOutput(**body)

    async def _post(self, server: str, payload: dict) -> dict:
        if self._session is None:  # created inside the running loop, as aiohttp requires
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
            # limit=0: no cap on connections. How many requests are in flight is the schedule's decision (the
            # engines are sized for it, rollout/engine_load.py); aiohttp's default of 100 per session would hold
            # the rest back without a word, and the engine would decode smaller batches than it was sized for.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        try:
            async with self._session.post(f"http://{server}/generate", data=msgspec.json.encode(payload),
                                          headers=JSON_HEADERS) as response:
                if response.status != 200:
                    raise EngineServerError(f"engine server {server} (rank {self.server_addresses.index(server)}) "
                                            f"answered HTTP {response.status}: {await response.text()}")
                return msgspec.json.decode(await response.read())  # the server's codec (async_server.py)
        except aiohttp.ClientError as err:
            raise EngineServerError(f"engine server {server} (rank {self.server_addresses.index(server)}) is "
                                    f"unreachable or died mid-request: {type(err).__name__}: {err}") from err

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def abort_servers(server_addresses: list[str], timeout_s: float = 30.0) -> None:
    """POST /abort to every engine server (from the controller, which has no event loop): each answers its requests
    under way with their tokens so far and stop_reason "aborted" (workers/rollout/async_server.py), and new ones
    likewise until reset_abort_servers or the next rollout mode."""
    _post_to_all(server_addresses, "abort", timeout_s)


def reset_abort_servers(server_addresses: list[str], timeout_s: float = 30.0) -> None:
    """POST /reset_abort to every engine server: after an abort whose requests are all answered, new ones generate."""
    _post_to_all(server_addresses, "reset_abort", timeout_s)


def _post_to_all(server_addresses: list[str], path: str, timeout_s: float) -> None:
    for rank, server in enumerate(server_addresses):
        request = urllib.request.Request(f"http://{server}/{path}", data=msgspec.json.encode({}), method="POST",
                                         headers=JSON_HEADERS)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                response.read()
        except Exception as err:
            raise EngineServerError(f"engine server {server} (rank {rank}) did not take the {path}: "
                                    f"{type(err).__name__}: {err}") from err
