"""Experiment tracking: one ``Tracking`` object fans each step's metrics out to the loggers in ``trainer.logger``.

Loggers (``VALID_LOGGERS``) and where their data goes:
  console      one line per step on stdout: ``step:N - key:value - key:value ...``
  jsonl        ``{local_dir}/metrics.jsonl``: one JSON object per step, ``{"step": N, <every metric>}``, appended
               (a resumed run continues the same file), and ``{local_dir}/config.json``: the resolved run config
               (rewritten at each start), so the run directory alone tells what ran (hybridrl/dashboard reads both)
  tensorboard  event files under ``{local_dir}/tensorboard``
  wandb        a wandb run (project, name, config). wandb's own environment is respected and nothing is defaulted:
               ``WANDB_MODE=offline`` for no network (runs land in ``$WANDB_DIR/wandb``), online needs a login.
  mlflow       the run in ``$MLFLOW_TRACKING_URI`` when set, else a file store under ``{local_dir}/mlruns``. mlflow
               >= 3.7 refuses file stores unless ``MLFLOW_ALLOW_FILE_STORE=true``; for that default store we set it
               (and say so in the log). Metric names must match mlflow's ``[/\\w.\\- :]``: ``@`` becomes ``_at_``
               and any other character outside the set becomes ``_``.

Validation samples (``log_generations``) go to wandb (a Table), tensorboard (a markdown text), mlflow (a JSON
artifact per step) and jsonl (``{local_dir}/val_generations.jsonl``); the console does not print them.

Each logger's package is imported only when that logger is asked for; a missing one says what to pip install.
Only the single controller process creates a Tracking.
"""
from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import time

logger = logging.getLogger(__name__)

GENERATION_COLUMNS = ("step", "input", "output", "score")


def _import_for(logger_name: str, module: str, pip_name: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(f"trainer.logger '{logger_name}' needs the {pip_name} package: pip install {pip_name}") \
            from error


def _as_float(key: str, value) -> float:
    """Metric values must be numbers (python, numpy or one-element torch tensors); anything else is a bug upstream."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"metric {key!r} has value {value!r}: expected a number")
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(f"metric {key!r} has value {value!r} of type {type(value).__name__}: expected a number") \
            from error


def _require_local_dir(logger_name: str, local_dir: str | None) -> str:
    if local_dir is None:
        raise ValueError(f"trainer.logger '{logger_name}' writes under local_dir, but local_dir is None")
    os.makedirs(local_dir, exist_ok=True)
    return local_dir


def format_value(value: float) -> str:
    """Compact: 6 significant digits, integers without a decimal point."""
    return f"{value:.6g}"


class ConsoleLogger:
    def __init__(self, project_name, experiment_name, config, local_dir):
        pass

    def log(self, data: dict[str, float], step: int) -> None:
        fields = [f"step:{step}"] + [f"{key}:{format_value(value)}" for key, value in data.items()]
        print(" - ".join(fields), file=sys.stdout, flush=True)

    def log_generations(self, rows: list[tuple], step: int) -> None:
        pass  # documented: validation tables are for the file and dashboard loggers

    def finish(self) -> None:
        pass


class JsonlLogger:
    def __init__(self, project_name, experiment_name, config, local_dir):
        local_dir = _require_local_dir("jsonl", local_dir)
        self.metrics_file = open(os.path.join(local_dir, "metrics.jsonl"), "a")
        if config is not None:
            with open(os.path.join(local_dir, "config.json"), "w") as f:
                json.dump(config, f, indent=1, default=str)
        self.generations_path = os.path.join(local_dir, "val_generations.jsonl")

    def log(self, data: dict[str, float], step: int) -> None:
        if "step" in data:
            raise ValueError("metric name 'step' is reserved in metrics.jsonl for the step number")
        self.metrics_file.write(json.dumps({"step": step, **data}) + "\n")
        self.metrics_file.flush()

    def log_generations(self, rows: list[tuple], step: int) -> None:
        with open(self.generations_path, "a") as f:
            for row in rows:
                f.write(json.dumps(dict(zip(GENERATION_COLUMNS, row))) + "\n")

    def finish(self) -> None:
        self.metrics_file.close()


class TensorboardLogger:
    def __init__(self, project_name, experiment_name, config, local_dir):
        _import_for("tensorboard", "tensorboard", "tensorboard")
        summary = _import_for("tensorboard", "torch.utils.tensorboard", "tensorboard")
        self.log_dir = os.path.join(_require_local_dir("tensorboard", local_dir), "tensorboard")
        self.writer = summary.SummaryWriter(log_dir=self.log_dir)
        if config is not None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, data: dict[str, float], step: int) -> None:
        for key, value in data.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, rows: list[tuple], step: int) -> None:
        lines = ["| " + " | ".join(GENERATION_COLUMNS[1:]) + " |", "|---|---|---|"]
        lines += [f"| {_markdown_cell(i)} | {_markdown_cell(o)} | {format_value(s)} |" for _, i, o, s in rows]
        self.writer.add_text("val/generations", "\n".join(lines), step)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


class WandbLogger:
    def __init__(self, project_name, experiment_name, config, local_dir):
        self.wandb = _import_for("wandb", "wandb", "wandb")
        self.run = self.wandb.init(project=project_name, name=experiment_name, config=config)

    def log(self, data: dict[str, float], step: int) -> None:
        self.run.log(data, step=step)

    def log_generations(self, rows: list[tuple], step: int) -> None:
        table = self.wandb.Table(columns=list(GENERATION_COLUMNS), data=[list(row) for row in rows])
        self.run.log({"val/generations": table}, step=step)

    def finish(self) -> None:
        self.run.finish()
        # finish() can return before the wandb service has written the run file (seen with wandb 0.31 offline);
        # teardown waits for the service to exit, so everything is on disk when Tracking.finish returns.
        self.wandb.teardown()


_MLFLOW_PARAM_VALUE_LIMIT = 6000  # mlflow rejects longer param values; the full config is an artifact anyway


class MlflowLogger:
    def __init__(self, project_name, experiment_name, config, local_dir):
        _import_for("mlflow", "mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.metric_type = Metric
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or self._default_file_store(local_dir)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        experiment = self.client.get_experiment_by_name(project_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project_name)
        self.run_id = self.client.create_run(experiment_id, run_name=experiment_name).info.run_id
        if config is not None:
            self.client.log_dict(self.run_id, config, "config.json")
            params = [Param(key, _mlflow_param_value(value)) for key, value in flatten(config).items()]
            for start in range(0, len(params), 100):  # mlflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[start:start + 100])

    @staticmethod
    def _default_file_store(local_dir: str | None) -> str:
        store = os.path.abspath(os.path.join(_require_local_dir("mlflow", local_dir), "mlruns"))
        if "MLFLOW_ALLOW_FILE_STORE" not in os.environ:
            logger.info("mlflow: using the file store %s (setting MLFLOW_ALLOW_FILE_STORE=true); set "
                        "MLFLOW_TRACKING_URI to use a database or server instead", store)
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        return "file://" + store

    def log(self, data: dict[str, float], step: int) -> None:
        timestamp_ms = int(time.time() * 1000)
        metrics = [self.metric_type(mlflow_metric_name(key), value, timestamp_ms, step) for key, value in data.items()]
        for start in range(0, len(metrics), 1000):  # mlflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def log_generations(self, rows: list[tuple], step: int) -> None:
        table = {"columns": list(GENERATION_COLUMNS), "data": [list(row) for row in rows]}
        self.client.log_dict(self.run_id, table, f"val_generations/step_{step}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def mlflow_metric_name(key: str) -> str:
    return re.sub(r"[^/\w.\- :]", "_", key.replace("@", "_at_"))


def _mlflow_param_value(value) -> str:
    text = str(value)
    return text if len(text) <= _MLFLOW_PARAM_VALUE_LIMIT else "(too long for an mlflow param: see config.json)"


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: the config as the key paths a command line overrides (an empty dict
    stays a value, so its key is not lost). mlflow's params, and the dashboard's config diff of runs, read it so."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


_LOGGERS = {"console": ConsoleLogger, "jsonl": JsonlLogger, "tensorboard": TensorboardLogger,
            "wandb": WandbLogger, "mlflow": MlflowLogger}
VALID_LOGGERS = tuple(sorted(_LOGGERS))


def check_logger_names(names: list[str]) -> None:
    """Config validation calls this before anything starts: unknown or repeated names fail early."""
    unknown = [name for name in names if name not in _LOGGERS]
    if unknown:
        raise ValueError(f"trainer.logger has unknown logger(s) {unknown}; valid names: {list(VALID_LOGGERS)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"trainer.logger lists {repeated} more than once")


class Tracking:
    """Log each step's metrics to every logger named in ``default_backend`` (verl's ``trainer.logger``).

    ``config`` is the resolved run config as a plain dict (``OmegaConf.to_container(cfg, resolve=True)``);
    ``local_dir`` is ``trainer.default_local_dir`` and is required by jsonl, tensorboard and the default mlflow store.
    """

    def __init__(self, project_name: str, experiment_name: str, default_backend: list[str],
                 config: dict | None = None, local_dir: str | None = None):
        names = [default_backend] if isinstance(default_backend, str) else list(default_backend)
        check_logger_names(names)
        self.loggers = {name: _LOGGERS[name](project_name, experiment_name, config, local_dir) for name in names}

    def log(self, data: dict[str, float], step: int) -> None:
        numbers = {key: _as_float(key, value) for key, value in data.items()}
        for backend in self.loggers.values():
            backend.log(numbers, step)

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """Log (input, output, score) validation samples as one table for this step."""
        rows = [(step, str(prompt), str(response), _as_float("score", score)) for prompt, response, score in samples]
        for backend in self.loggers.values():
            backend.log_generations(rows, step)

    def finish(self) -> None:
        """Flush and close every logger; a second call does nothing."""
        for backend in self.loggers.values():
            backend.finish()
        self.loggers = {}
