"""What the engine server itself costs per request: its JSON codec, and 512 concurrent requests admitted and answered
with an engine that answers at once (issue 26: the agent loops' requests reach SGLang one by one, on the one event
loop that also answers them, so every millisecond the server spends per request delays the last one).

    PYTHONPATH=. python benchmarks/engine_server_requests.py [--requests 512] [--clients 8] [--out FILE]

Two parts, one table each:
  codec    encoding and decoding `--requests` answers of `--tokens` token ids and log-probs (and as many requests of
           `--prompt-tokens` ids) with the standard library's json (the baseline) and msgspec's (what the server and
           its client use, async_server.py and agent_loop/server_manager.py)
  server   an EngineServer on 127.0.0.1 in this process; `--clients` processes (the agent-loop workers) send
           `--requests` requests at once through AsyncLLMServerManager, after one warm-up request each; the engine
           answers each at once with `--tokens` random tokens and log-probs. Reported: how long after the start
           signal the engine saw the first and the last request (the admission spread), when the last client had
           all its answers, and the connections the kernel dropped because the server's listen queue was full
           (TcpExt ListenOverflows of /proc/net/netstat, counted across this machine's network namespace: each one
           costs its request a second, the client kernel's retry). The engine's own work is nil here, so what is
           measured is the server's and the clients'.
The real engine behind the server is measured on a GPU by benchmarks/agent_loop_gap.py.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import time

import msgspec


def random_answer(tokens: int, rng: random.Random) -> dict:
    return {"token_ids": [rng.randrange(151_936) for _ in range(tokens)], "stop_reason": "length",
            "log_probs": [-rng.expovariate(1.0) for _ in range(tokens)], "weight_version": 3}


def codec_table(requests: int, tokens: int, prompt_tokens: int, repeats: int = 3) -> dict:
    """Seconds to encode and to decode `requests` answers and requests with each codec (best of `repeats`)."""
    rng = random.Random(0)
    answers = [random_answer(tokens, rng) for _ in range(requests)]
    prompts = [{"request_id": f"r{i}", "prompt_ids": [rng.randrange(151_936) for _ in range(prompt_tokens)],
                "sampling_params": {"temperature": 1.0, "logprobs": True}} for i in range(requests)]
    codecs = {"json": (lambda value: json.dumps(value).encode(), json.loads),
              "msgspec": (msgspec.json.encode, msgspec.json.decode)}
    table = {}
    for name, (encode, decode) in codecs.items():
        row = {}
        for what, values in (("answers", answers), ("requests", prompts)):
            encoded = [encode(value) for value in values]
            assert [decode(blob) for blob in encoded] == values  # both codecs round-trip every value exactly
            row[f"encode_{what}_s"] = best_of(repeats, lambda: [encode(value) for value in values])
            row[f"decode_{what}_s"] = best_of(repeats, lambda: [decode(blob) for blob in encoded])
        table[name] = row
    return table


def best_of(repeats: int, work) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


class InstantEngine:
    """Answers every request at once (the server's AsyncEngine protocol), noting when each arrived."""

    def __init__(self, tokens: int):
        self.answer = random_answer(tokens, random.Random(1))
        self.arrived: list[float] = []

    async def generate(self, prompt_ids, sampling_params):
        self.arrived.append(time.monotonic())
        return dict(self.answer)


def client(address: str, requests: int, prompt_tokens: int, ready, start, results) -> None:
    """One agent-loop worker's share: `requests` concurrent generate calls once `start` is set; puts the monotonic
    time its last answer arrived."""
    from hybridrl.agent_loop.server_manager import AsyncLLMServerManager

    async def run():
        manager = AsyncLLMServerManager([address])
        rng = random.Random()
        prompts = [[rng.randrange(151_936) for _ in range(prompt_tokens)] for _ in range(requests)]
        params = {"temperature": 1.0, "logprobs": True}
        await manager.generate("warm-up", prompt_ids=prompts[0], sampling_params=params)
        ready.put(True)
        while not start.is_set():
            await asyncio.sleep(0.001)
        answers = await asyncio.gather(*(manager.generate(f"r{i}", prompt_ids=prompt, sampling_params=params)
                                         for i, prompt in enumerate(prompts)))
        results.put((time.monotonic(), sum(len(answer.token_ids) for answer in answers)))
        await manager.close()

    asyncio.run(run())


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped at a full listen queue (None where /proc/net/netstat is absent)."""
    try:
        with open("/proc/net/netstat") as handle:
            lines = [line.split() for line in handle if line.startswith("TcpExt:")]
    except OSError:
        return None
    names, values = lines[0], lines[1]
    return int(values[names.index("ListenOverflows")])


def server_run(requests: int, clients: int, tokens: int, prompt_tokens: int) -> dict:
    from hybridrl.workers.rollout.async_server import EngineServer

    engine = InstantEngine(tokens)
    server = EngineServer(engine, "127.0.0.1")
    server.serve(weight_version=3)
    context = multiprocessing.get_context("spawn")
    ready, results, start = context.Queue(), context.Queue(), context.Event()
    shares = [requests // clients + (rank < requests % clients) for rank in range(clients)]
    processes = [context.Process(target=client, args=(server.address, share, prompt_tokens, ready, start, results))
                 for share in shares]
    try:
        for process in processes:
            process.start()
        for _ in processes:
            ready.get(timeout=120)
        engine.arrived.clear()  # the warm-up requests
        overflows_before = listen_overflows()
        started = time.monotonic()
        start.set()
        finished = [results.get(timeout=300) for _ in processes]
        overflows = None if overflows_before is None else listen_overflows() - overflows_before
        for process in processes:
            process.join(timeout=60)
    finally:
        server.shutdown()
    if len(engine.arrived) != requests or sum(count for _, count in finished) != requests * tokens:
        raise RuntimeError(f"expected {requests} requests of {tokens} tokens, the engine saw {len(engine.arrived)} "
                           f"and the clients got {sum(count for _, count in finished)} tokens")
    return {"requests": requests, "clients": clients, "first_request_s": min(engine.arrived) - started,
            "last_request_s": max(engine.arrived) - started, "last_answer_s": max(at for at, _ in finished) - started,
            "listen_overflows": overflows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--clients", type=int, default=8, help="client processes (rollout.agent.num_workers)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens (and log-probs) in each answer")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3, help="server runs (the table shows their median)")
    parser.add_argument("--out", help="write the numbers here as JSON")
    args = parser.parse_args()

    codecs = codec_table(args.requests, args.tokens, args.prompt_tokens)
    print(f"\ncodec: {args.requests} answers of {args.tokens} tokens and log-probs, {args.requests} requests of "
          f"{args.prompt_tokens} ids (seconds, best of 3)")
    columns = list(codecs["json"])
    print(f"{'':<10}" + "".join(f"{column:>20}" for column in columns))
    for name, row in codecs.items():
        print(f"{name:<10}" + "".join(f"{row[column]:>20.4f}" for column in columns))
    runs = [server_run(args.requests, args.clients, args.tokens, args.prompt_tokens) for _ in range(args.runs)]
    median = {key: statistics.median(run[key] for run in runs) for key in ("first_request_s", "last_request_s",
                                                                           "last_answer_s")}
    print(f"\nserver: {args.requests} concurrent requests from {args.clients} client processes, an engine that "
          f"answers at once (median of {args.runs} runs, seconds after the start)")
    for key, value in median.items():
        print(f"  {key:<18} {value:.3f}   (runs: {', '.join(f'{run[key]:.3f}' for run in runs)})")
    print(f"  {'listen_overflows':<18} runs: {', '.join(str(run['listen_overflows']) for run in runs)}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"args": vars(args), "codec": codecs, "server_runs": runs, "server_median": median}, handle,
                      indent=1)


if __name__ == "__main__":
    main()
