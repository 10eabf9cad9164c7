"""What one code-interpreter call costs: the sandbox (namespaces, minimal root, cgroup, seccomp) against a bare
`python -I -c ...` process doing the same work, the floor any per-call process pays. Prints a table.

    python benchmarks/sandbox_call.py [--calls 20]
"""
import argparse
import asyncio
import statistics
import subprocess
import sys
import time

from hybridrl.tools.sandbox import SandboxLimits, memory_cgroup_root, run_python

CODE = "print(sum(range(1000)))"


async def sandbox_call() -> None:
    result = await run_python(CODE, SandboxLimits())
    assert result.exit_code == 0 and result.output == "499500\n", result.output


async def bare_call() -> None:
    process = await asyncio.create_subprocess_exec(sys.executable, "-I", "-c", CODE, stdout=subprocess.PIPE,
                                                   stdin=subprocess.DEVNULL)
    output, _ = await process.communicate()
    assert output == b"499500\n"


async def seconds(call, calls: int) -> list[float]:
    timings = []
    for _ in range(calls):
        started = time.perf_counter()
        await call()
        timings.append(time.perf_counter() - started)
    return sorted(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    print(f"memory cgroup: {memory_cgroup_root() or 'none (RLIMIT_AS and the tmpfs size only)'}")
    print("| process | median s | p90 s |\n|---|---|---|")
    for name, call in (("bare python -I", bare_call), ("sandbox", sandbox_call)):
        timings = asyncio.run(seconds(call, args.calls))
        print(f"| {name} | {statistics.median(timings):.3f} | {timings[int(0.9 * (len(timings) - 1))]:.3f} |")


if __name__ == "__main__":
    main()
