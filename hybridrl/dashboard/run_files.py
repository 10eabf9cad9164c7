"""What one run directory holds, read for the dashboard: finished, still being written, or copied off a cluster.

A run's ``trainer.default_local_dir`` holds, with ``trainer.logger`` including ``jsonl`` (trainer/tracking.py):
  metrics.jsonl          one object per step, ``{"step": N, <metric>: value, ...}``, appended as the run goes
  config.json            the resolved run config
  val_generations.jsonl  ``trainer.log_val_generations`` validation samples, ``{step, input, output, score}``
  summary.json           written when the run ends (trainer/ppo/ray_trainer.py ``_finish``)
  global_step_N/         checkpoints
and, where the config names them, the per-step dumps of ``trainer.rollout_data_dir`` and
``trainer.validation_data_dir`` (trainer/ppo/generation_dump.py: ``{dir}/{step}.jsonl``).

A dump directory inside the run directory is found there even when the run directory was moved or copied (its path
in config.json is the cluster's); one outside it is read at the path the config names.
"""
from __future__ import annotations

import json
import math
import os
import re
import threading

import msgspec

from hybridrl.trainer.tracking import flatten

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
VAL_GENERATIONS_FILE = "val_generations.jsonl"
# generation_dump.SIZE_LIMIT_FILE, named again here: importing it would import torch into the dashboard
SIZE_LIMIT_FILE = "size_limit_reached.json"
CHECKPOINT_DIR = re.compile(r"^global_step_(\d+)$")
DUMP_FILE = re.compile(r"^(\d+)\.jsonl$")


class RunDirError(ValueError):
    """A run directory the dashboard cannot read; the message names the path and what was expected."""


def check_run_dir(path: str) -> None:
    """Refuse, before the server starts, a path that is no run directory (it must hold metrics.jsonl)."""
    if not os.path.isdir(path):
        raise RunDirError(f"{path}: expected a run directory (trainer.default_local_dir), but it is not a directory")
    if not os.path.isfile(os.path.join(path, METRICS_FILE)):
        raise RunDirError(f"{path}: expected {METRICS_FILE} in it (written by trainer.logger=[console,jsonl]); "
                          f"it holds {sorted(os.listdir(path))}")


def _finite_or_none(value):
    """JSON has no NaN or inf: a non-finite metric is drawn as a gap."""
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _decode_json(line: bytes):
    """msgspec's decoder (4x faster than json's on a 300-metric line); json's for a line with NaN or Infinity,
    which json.dumps writes for a non-finite metric and msgspec refuses."""
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError:
        return json.loads(line)


class MetricsLog:
    """metrics.jsonl as columns, read incrementally: each ``refresh`` reads only the lines added since the last.

    A line without its newline is still being written and waits for the next refresh. A resumed run appends the
    steps after its checkpoint again: the rows from that step on are replaced by the new ones, and ``revision``
    goes up so that a page drawing the old rows starts over.
    """

    def __init__(self, path: str):
        self.path = path
        self.offset = 0  # bytes of the file read so far (complete lines only)
        self.revision = 0
        self.steps: list[int] = []
        self.columns: dict[str, list] = {}  # metric -> one value (or None) per row of self.steps
        self.lock = threading.Lock()

    def refresh(self) -> None:
        with self.lock, open(self.path, "rb") as f:
            f.seek(self.offset)
            added = f.read()
            complete = added[:added.rfind(b"\n") + 1]
            for number, line in enumerate(complete.splitlines()):
                if line.strip():
                    self._add_row(self._parse(line, number))
            self.offset += len(complete)

    def _parse(self, line: bytes, number: int) -> dict:
        try:
            row = _decode_json(line)
        except json.JSONDecodeError as err:
            raise RunDirError(f"{self.path}: a line after byte {self.offset} (the {number + 1}th new one) is not "
                              f"JSON ({err}): {line[:200]!r}") from err
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise RunDirError(f"{self.path}: expected objects with an integer 'step', got {line[:200]!r}")
        return row

    def _add_row(self, row: dict) -> None:
        step = row.pop("step")
        if self.steps and step <= self.steps[-1]:
            self._truncate_from(step)
        for key in row.keys() - self.columns.keys():
            self.columns[key] = [None] * len(self.steps)
        self.steps.append(step)
        for key, column in self.columns.items():
            column.append(_finite_or_none(row.get(key)))

    def _truncate_from(self, step: int) -> None:
        keep = next(i for i, logged in enumerate(self.steps) if logged >= step)
        del self.steps[keep:]
        for column in self.columns.values():
            del column[keep:]
        self.revision += 1

    def series(self, keys: list[str], since: int) -> dict:
        """Rows ``since`` onwards of the named metrics: ``{"steps", "values": {key: [...]}, "rows", "revision"}``."""
        with self.lock:
            unknown = [key for key in keys if key not in self.columns]
            if unknown:
                raise KeyError(f"{self.path} has no metric {unknown}")
            return {"steps": self.steps[since:], "values": {key: self.columns[key][since:] for key in keys},
                    "rows": len(self.steps), "revision": self.revision}


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise RunDirError(f"{path}: expected JSON ({err})") from err


def read_jsonl(path: str) -> list[dict]:
    """Every complete line of a jsonl file; a last line without its newline is still being written."""
    with open(path) as f:
        text = f.read()
    rows = []
    for number, line in enumerate(text[:text.rfind("\n") + 1].splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise RunDirError(f"{path}, line {number}: expected a JSON object ({err})") from err
    return rows


class RunDir:
    """One run directory: its metrics (incremental), config, summary, checkpoints and generation dumps."""

    def __init__(self, path: str):
        check_run_dir(path)
        self.path = os.path.abspath(path)
        self.name = os.path.basename(self.path.rstrip(os.sep))
        self.metrics = MetricsLog(os.path.join(self.path, METRICS_FILE))
        self.metrics.refresh()  # the bulk of a long run is read before the server answers, not on the first request

    def config(self) -> dict | None:
        return _read_json(os.path.join(self.path, CONFIG_FILE))

    def summary(self) -> dict | None:
        return _read_json(os.path.join(self.path, SUMMARY_FILE))

    def checkpoints(self) -> list[int]:
        steps = [CHECKPOINT_DIR.match(name) for name in os.listdir(self.path)]
        return sorted(int(match.group(1)) for match in steps if match)

    def dump_dir(self, key: str) -> str | None:
        """Where ``trainer.<key>`` (rollout_data_dir, validation_data_dir) put its dumps, or None when unset."""
        config = self.config()
        if config is None or not config["trainer"].get(key):
            return None
        configured = os.path.normpath(config["trainer"][key])
        run_dir_then = os.path.normpath(config["trainer"]["default_local_dir"])
        if os.path.commonpath([configured, run_dir_then]) == run_dir_then:  # inside the run dir: follow it here
            return os.path.join(self.path, os.path.relpath(configured, run_dir_then))
        return configured

    def dump_steps(self, key: str) -> list[int]:
        directory = self.dump_dir(key)
        if directory is None or not os.path.isdir(directory):
            return []
        matches = [DUMP_FILE.match(name) for name in os.listdir(directory)]
        return sorted(int(match.group(1)) for match in matches if match)

    def rollout_dump_limit(self) -> dict | None:
        """size_limit_reached.json of the rollout dumps: where trainer.rollout_data_max_mb stopped them, if it did."""
        directory = self.dump_dir("rollout_data_dir")
        return None if directory is None else _read_json(os.path.join(directory, SIZE_LIMIT_FILE))

    def dump(self, key: str, step: int) -> list[dict]:
        """The samples ``trainer.<key>`` dumped at ``step``."""
        directory = self.dump_dir(key)
        if directory is None:
            raise KeyError(f"{self.path}: trainer.{key} was not set in this run, so nothing was dumped")
        path = os.path.join(directory, f"{step}.jsonl")
        if not os.path.isfile(path):
            raise KeyError(f"{path}: no dump of step {step}; dumped steps: {self.dump_steps(key)}")
        return read_jsonl(path)

    def validation_answers(self) -> list[dict]:
        """Every validation sample the run kept: the full dumps of validation_data_dir when set, else the
        ``log_val_generations`` samples of val_generations.jsonl. Each ``{step, input, output, score}``."""
        steps = self.dump_steps("validation_data_dir")
        if steps:
            return [row for step in steps for row in self.dump("validation_data_dir", step)]
        path = os.path.join(self.path, VAL_GENERATIONS_FILE)
        return read_jsonl(path) if os.path.isfile(path) else []

    def overview(self) -> dict:
        """What the page polls: the run's size, metric names, summary, checkpoints and dumped steps."""
        self.metrics.refresh()
        with self.metrics.lock:
            rows, revision = len(self.metrics.steps), self.metrics.revision
            last_step = self.metrics.steps[-1] if rows else None
            metric_names = sorted(self.metrics.columns)
        return {"name": self.name, "path": self.path, "rows": rows, "revision": revision, "last_step": last_step,
                "metrics": metric_names, "summary": self.summary(), "checkpoints": self.checkpoints(),
                "rollout_steps": self.dump_steps("rollout_data_dir"), "rollout_dump_limit": self.rollout_dump_limit(),
                "has_config": os.path.isfile(os.path.join(self.path, CONFIG_FILE))}


def compare_configs(configs: list[dict | None]) -> dict:
    """The runs' configs side by side as key paths: ``{"keys", "values": [per run {key: value}], "differ"}``; a key
    differs when the runs that have a config do not all give it the same value (or one of them lacks it)."""
    flat = [flatten(config) if config is not None else None for config in configs]
    present = [values for values in flat if values is not None]
    keys = sorted({key for values in present for key in values})
    differ = [key for key in keys if len({json.dumps(values.get(key, "<missing>"), sort_keys=True, default=str)
                                          for values in present}) > 1]
    return {"keys": keys, "values": flat, "differ": differ}
