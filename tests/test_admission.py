"""Admission in batches (workers/rollout/admission.py) on a real asyncio loop: the requests whose handlers run in one
loop iteration are admitted together, each answered as its own answer comes, and no request is left waiting when the
engine's admit fails, is cancelled, or forgets one. SGLang's admit (sglang_async.py) runs on a GPU:
tests/gpu/test_engine_async_server.py."""
import asyncio

import pytest

from hybridrl.workers.rollout.admission import AdmissionBatcher, answer


def run(coroutine):
    return asyncio.new_event_loop().run_until_complete(coroutine)


def test_requests_sent_together_are_one_batch_each_answered_when_its_own_answer_comes():
    admitted, finished = [], []

    async def admit(items, futures):
        admitted.append(list(items))
        for item, future in sorted(zip(items, futures), reverse=True):  # the longest first: answers out of order
            await asyncio.sleep(0)
            answer(future, item * 10)

    batcher = AdmissionBatcher(admit)

    async def request(item):
        result = await batcher.submit(item)
        finished.append(item)
        return result

    async def main():
        together = await asyncio.gather(*(request(item) for item in (1, 2, 3)))
        alone = await request(4)
        return together, alone

    together, alone = run(main())
    assert together == [10, 20, 30] and alone == 40
    assert admitted == [[1, 2, 3], [4]]
    assert list(batcher.batch_sizes) == [3, 1]
    assert finished == [3, 2, 1, 4]  # each request returned as its answer was set, not when the batch's last was


def test_an_admit_that_raises_fails_every_request_of_its_batch_with_its_error():
    async def admit(items, futures):
        answer(futures[0], "first")
        raise ValueError("scheduler rejected the batch")

    batcher = AdmissionBatcher(admit)

    async def main():
        return await asyncio.gather(*(batcher.submit(item) for item in range(3)), return_exceptions=True)

    results = run(main())
    assert results[0] == "first"
    assert [str(error) for error in results[1:]] == ["scheduler rejected the batch"] * 2


def test_an_admit_that_returns_with_requests_unanswered_fails_them_saying_so():
    async def admit(items, futures):
        answer(futures[1], "only this one")

    batcher = AdmissionBatcher(admit)

    async def main():
        return await asyncio.gather(*(batcher.submit(item) for item in range(3)), return_exceptions=True)

    first, second, third = run(main())
    assert second == "only this one"
    for error in (first, third):
        assert isinstance(error, RuntimeError) and "2 of 3 requests of its batch unanswered" in str(error)


def test_a_cancelled_admit_cancels_its_requests_and_a_gone_request_does_not_break_the_others():
    gate = {}

    async def admit(items, futures):
        gate["futures"] = futures
        await asyncio.sleep(3600)  # the engine never answers: its monitor cancels the loop's tasks

    batcher = AdmissionBatcher(admit)

    async def main():
        requests = [asyncio.ensure_future(batcher.submit(item)) for item in range(2)]
        await asyncio.sleep(0.01)
        requests[0].cancel()  # a handler gone: answer() on its future must not raise
        answer(gate["futures"][0], "late")
        for task in batcher._running:
            task.cancel()
        # a future the cancelled admit left unset would hang here: the timeout makes that a failure
        return await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), timeout=30)

    results = run(main())
    assert all(isinstance(result, asyncio.CancelledError) for result in results)


@pytest.mark.parametrize("count", [1, 64])
def test_every_request_of_a_burst_is_admitted_exactly_once(count):
    seen = []

    async def admit(items, futures):
        seen.extend(items)
        for item, future in zip(items, futures):
            answer(future, item)

    batcher = AdmissionBatcher(admit)

    async def main():
        return await asyncio.gather(*(batcher.submit(item) for item in range(count)))

    assert run(main()) == list(range(count))
    assert sorted(seen) == list(range(count)) and sum(batcher.batch_sizes) == count
