"""Admission in batches: the requests that reach an engine server together go to the engine as one batch.

Why: agent loops send their requests one by one, but at the start of a step hundreds of them arrive within a fraction
of a second. Handed to SGLang one at a time, each costs the server's event loop its own trip through the tokenizer
manager and its own message to the scheduler, while the requests behind it wait on the same loop; the last of 512
reached the server 0.258 s after the call began, 0.053 s with admission in batches (H200, 512 requests,
benchmarks/README.md "Session 27", issue 26). The batch path hands SGLang all its requests in one message too. The
agent loops' speed did not move with it (0.944 against 0.955 of the batch path's, as ratios of times, within the
turns' noise): what is left of that gap is not admission.

How: the first request of an event-loop iteration schedules a flush for the next iteration (`call_soon`); every
request whose handler runs before that flush joins it. Nothing waits on a timer, so a lone request is admitted at
once, and the busier the loop, the larger the batches it forms. Each request is still answered as soon as its own
generation finishes: `admit(items, futures)` sends the batch and resolves each future on its own.
"""
from __future__ import annotations

import asyncio
from collections import deque
from typing import Any, Awaitable, Callable

Admit = Callable[[list[Any], list[asyncio.Future]], Awaitable[None]]


class AdmissionBatcher:
    """Collects the items submitted in one event-loop iteration and runs `admit(items, futures)` on them together.

    `admit` owns the futures (one per item, in order): it sets each one's result (`answer`) when that item's answer
    comes. If it raises, or is cancelled (an engine that died: its monitor cancels the loop's tasks), every future it
    left unset gets that error; if it returns with some unset, they get an error saying so: no request waits
    forever."""

    def __init__(self, admit: Admit):
        self.admit = admit
        self.batch_sizes: deque[int] = deque(maxlen=4096)  # the items of each recent batch, in order (tests read it)
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._running: set[asyncio.Task] = set()  # admitted batches still being answered (held: tasks are weak)

    async def submit(self, item: Any) -> Any:
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._flush)
        future = loop.create_future()
        self._pending.append((item, future))
        return await future

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        self.batch_sizes.append(len(batch))
        task = asyncio.get_running_loop().create_task(self._run([item for item, _ in batch],
                                                                [future for _, future in batch]))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, items: list[Any], futures: list[asyncio.Future]) -> None:
        try:
            await self.admit(items, futures)
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise
        except Exception as err:
            for future in futures:
                fail(future, err)
            return
        unanswered = sum(not future.done() for future in futures)
        for future in futures:
            fail(future, RuntimeError(f"admission: the engine's admit returned with {unanswered} of {len(futures)} "
                                      f"requests of its batch unanswered"))


def answer(future: asyncio.Future, result: Any) -> None:
    """Set a request's answer unless the request is gone (its handler cancelled: the future is done already)."""
    if not future.done():
        future.set_result(result)


def fail(future: asyncio.Future, error: BaseException) -> None:
    """Set a request's error unless it is answered or gone already."""
    if not future.done():
        future.set_exception(error)
