"""The TaskRunner's last lines reach the driver's console before the driver shuts Ray down.

A Ray worker's stdout and stderr reach the driver through Ray's log forwarding: the worker writes them to files,
Ray's log monitor reads the files (every 0.1 s when idle) and publishes new lines through the GCS, and a thread of
the driver prints them. `ray.shutdown()` stops that thread, and the local cluster's end stops the monitor, with
whatever is still on its way: the last step's line was missing from the console in 14 of 22 runs (Ray drops them
by design: ray-project/ray#31931). So once the TaskRunner is done, the driver has it print END_OF_OUTPUT on both
streams and waits until both lines have been forwarded; the monitor reads each file in order, so every earlier line
has been forwarded too. Ray's forwarding filter (RAY_DEDUP_LOGS_SKIP_REGEX, read when Ray is imported) keeps the
marker itself off the console.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time

END_OF_OUTPUT = "hybridrl: end of the TaskRunner's output"
SKIP_REGEX_ENV = "RAY_DEDUP_LOGS_SKIP_REGEX"
FORWARDING_TIMEOUT_S = 30.0  # far beyond the monitor's 0.1 s poll, for a loaded machine
_HANDLER_NAME = "hybridrl_end_of_output"


def hide_end_of_output() -> None:
    """Keep END_OF_OUTPUT off the console (a user's own RAY_DEDUP_LOGS_SKIP_REGEX still applies); call it before
    the driver imports ray."""
    marker = re.escape(END_OF_OUTPUT)
    own = os.environ.get(SKIP_REGEX_ENV)
    if own is None or marker not in own:
        os.environ[SKIP_REGEX_ENV] = f"(?:{own})|{marker}" if own else marker


def print_end_of_output() -> None:
    """In the TaskRunner, once its run is over: the last line of its stdout and of its stderr."""
    print(END_OF_OUTPUT, flush=True)
    print(END_OF_OUTPUT, file=sys.stderr, flush=True)


def wait_for_runner_output(runner, timeout_s: float = FORWARDING_TIMEOUT_S) -> None:
    """Have `runner` (a TaskRunner done with its run) end its output, and return once the driver has printed it all.

    A runner that is gone (killed by a stop, or dead) has nothing more to say: no wait. Output that is still not
    forwarded after `timeout_s` is named in a warning (it stays in Ray's worker log files)."""
    import ray
    from ray._private.ray_logging import global_worker_stdstream_dispatcher  # every forwarded batch of lines

    arrived = {"stdout": threading.Event(), "stderr": threading.Event()}

    def on_forwarded(batch: dict) -> None:  # on the driver's printing thread, after Ray printed the batch
        if any(END_OF_OUTPUT in line for line in batch.get("lines", ())):
            arrived["stderr" if batch.get("is_err") else "stdout"].set()

    global_worker_stdstream_dispatcher.add_handler(_HANDLER_NAME, on_forwarded)
    try:
        try:
            ray.get(runner.end_output.remote(), timeout=timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return
        deadline = time.monotonic() + timeout_s
        missing = [name for name, event in arrived.items() if not event.wait(max(0.0, deadline - time.monotonic()))]
        if missing:
            print(f"warning: the TaskRunner's last {' and '.join(missing)} lines did not reach this console within "
                  f"{timeout_s:g} s (Ray's log forwarding); they are in the worker-*.out/.err files of Ray's session "
                  f"logs", file=sys.stderr, flush=True)
    finally:
        global_worker_stdstream_dispatcher.remove_handler(_HANDLER_NAME)
