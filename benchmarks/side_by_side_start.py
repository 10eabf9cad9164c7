"""Two runs' local Ray clusters started at the same moment on one machine, against a lone start (issue 31).

Each round starts one head alone (the baseline), then two at once, each from its own driver process as two
`python -m hybridrl.main_ppo` runs would (single_controller/local_cluster.py), and reports every start's seconds and
the slower of the two against the lone one. It also measures how much of the machine's CPUs a lone start keeps busy
(/proc/stat): on a machine where one start already keeps most of the CPUs busy, two cannot both be up in much less
than twice its time, whatever the ports and locks do.

    python benchmarks/side_by_side_start.py [--rounds 3] [--out results.json]

Prints a table; --out also writes the rounds as JSON (written after every round, so a cut-off run keeps them).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One driver: start a head as a run does, report its start in seconds and the machine's busy CPU time over it, stop.
DRIVER = '''
import json, os, time
from hybridrl.single_controller.local_cluster import LocalRayCluster, prepare_driver_process

def busy_and_total():
    fields = [int(value) for value in open("/proc/stat").readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)  # all but idle and iowait

prepare_driver_process(None)
cluster = LocalRayCluster(num_cpus=None, node_ip_address=None, include_dashboard=False, start_timeout_s=None)
busy0, total0 = busy_and_total()
began = time.monotonic()
cluster.start()
seconds = time.monotonic() - began
busy1, total1 = busy_and_total()
cluster.stop()
print(json.dumps({"start_s": seconds, "busy_cpu_s": (busy1 - busy0) / os.sysconf("SC_CLK_TCK"),
                  "busy_share": (busy1 - busy0) / max(total1 - total0, 1)}))
'''


def start_drivers(count: int) -> list[dict]:
    """`count` drivers started at once; each one's report."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))}
    drivers = [subprocess.Popen([sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for _ in range(count)]
    reports = []
    for driver in drivers:
        out, err = driver.communicate(timeout=600)
        if driver.returncode != 0:
            raise RuntimeError(f"a driver failed (exit {driver.returncode}): {err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rounds as JSON here")
    args = parser.parse_args()
    record = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "rounds": []}
    try:
        import ray
        record["machine"]["ray"] = ray.__version__
    except ImportError:
        pass
    print(f"{'round':>5} | {'load':>5} | {'lone s':>6} | {'lone busy':>9} | {'together s':>13} | {'slower/lone':>11}")
    for index in range(1, args.rounds + 1):
        time.sleep(5)  # the previous round's processes gone
        load = os.getloadavg()[0]
        lone = start_drivers(1)[0]
        together = start_drivers(2)
        ratio = max(report["start_s"] for report in together) / lone["start_s"]
        record["rounds"].append({"load_1min": load, "lone": lone, "together": together, "slower_over_lone": ratio})
        print(f"{index:>5} | {load:>5.2f} | {lone['start_s']:>6.1f} | {lone['busy_share']:>8.0%} "
              f"| {together[0]['start_s']:>5.1f} and {together[1]['start_s']:>4.1f} | {ratio:>10.2f}x", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
