"""The `hybridrl` loggers' level and output, set once per process (the driver and every Ray worker import this
package, so each process gets it).

Without it Python prints only warnings from a library logger, so what the engines report at start (the CUDA-graph
size chosen for the schedule's load, the engine's arguments and start time) was never seen. verl reads
VERL_LOGGING_LEVEL for the same purpose; here it is HYBRIDRL_LOGGING_LEVEL, default INFO. Records still propagate
to the root logger, so pytest's caplog and a user's own handlers see them as before (and print them: then no
handler is added here).
"""
from __future__ import annotations

import logging
import os

LEVEL_ENV = "HYBRIDRL_LOGGING_LEVEL"


def configure_logging() -> None:
    """Give the `hybridrl` logger the level of HYBRIDRL_LOGGING_LEVEL (INFO by default), and a stderr handler when
    nothing else would print its records (no handler on the root logger: a user's or pytest's would)."""
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"{LEVEL_ENV}={os.environ[LEVEL_ENV]!r}: expected one of DEBUG, INFO, WARNING, ERROR, "
                         f"CRITICAL")
    logger = logging.getLogger("hybridrl")
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
