"""Every logger writes what it should, read back with the logger's own reader; plus the progress display."""
import glob
import io
import json
import os
import struct
import sys

import numpy as np
import pytest
import torch

from hybridrl.trainer.progress import ProgressReporter, format_step_table
from hybridrl.trainer.tracking import VALID_LOGGERS, Tracking, check_logger_names, flatten

CONFIG = {"trainer": {"total_epochs": 2, "logger": ["wandb"]}, "actor": {"lr": 1e-6}}
STEP_METRICS = {1: {"actor/pg_loss": 0.5, "critic/score/mean": 0.25},
                2: {"actor/pg_loss": -0.125, "critic/score/mean": 0.75}}
SAMPLES = [("1+1=", "2", 1.0), ("2+2=", "5", 0.0)]


def _run(names, tmp_path, **kwargs):
    tracker = Tracking("proj", "exp", names, config=CONFIG, local_dir=str(tmp_path), **kwargs)
    for step, metrics in STEP_METRICS.items():
        tracker.log(metrics, step=step)
    tracker.log_generations(SAMPLES, step=2)
    tracker.finish()
    return tracker


def test_logger_names_are_checked_before_anything_starts(tmp_path):
    assert VALID_LOGGERS == ("console", "jsonl", "mlflow", "tensorboard", "wandb")
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['tensorbord'\]; valid names: \['console', 'jsonl', "
                                         r"'mlflow', 'tensorboard', 'wandb'\]"):
        Tracking("p", "e", ["console", "tensorbord"], local_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"lists \['jsonl'\] more than once"):
        check_logger_names(["jsonl", "console", "jsonl"])
    with pytest.raises(ValueError, match="'jsonl' writes under local_dir, but local_dir is None"):
        Tracking("p", "e", ["jsonl"])


def test_console_prints_one_compact_line_per_step(capsys):
    tracker = Tracking("p", "e", "console")
    tracker.log({"a": 0.5, "b/c": 3, "d": np.float32(1.25), "e": torch.tensor(2.0), "f": 1 / 3, "g": 1234567.0},
                step=7)
    assert capsys.readouterr().out == "step:7 - a:0.5 - b/c:3 - d:1.25 - e:2 - f:0.333333 - g:1.23457e+06\n"
    with pytest.raises(TypeError, match="metric 'name' has value 'x': expected a number"):
        tracker.log({"name": "x"}, step=8)
    with pytest.raises(TypeError, match=r"metric 'v' has value \[1, 2\] of type list"):
        tracker.log({"v": [1, 2]}, step=8)


def test_jsonl_appends_one_object_per_step_and_generations(tmp_path):
    _run(["jsonl"], tmp_path)
    _run(["jsonl"], tmp_path)  # a resumed run appends to the same file
    with open(tmp_path / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    one_run = [{"step": 1, "actor/pg_loss": 0.5, "critic/score/mean": 0.25},
               {"step": 2, "actor/pg_loss": -0.125, "critic/score/mean": 0.75}]
    assert lines == one_run + one_run
    with open(tmp_path / "config.json") as f:
        assert json.load(f) == CONFIG
    with open(tmp_path / "val_generations.jsonl") as f:
        assert [json.loads(line) for line in f][:2] == [
            {"step": 2, "input": "1+1=", "output": "2", "score": 1.0},
            {"step": 2, "input": "2+2=", "output": "5", "score": 0.0}]
    with pytest.raises(ValueError, match="'step' is reserved"):
        Tracking("p", "e", ["jsonl"], local_dir=str(tmp_path)).log({"step": 1.0}, step=1)


def test_tensorboard_event_file_holds_scalars_and_generation_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(["tensorboard"], tmp_path)
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert [(e.step, e.value) for e in accumulator.Scalars("actor/pg_loss")] == [(1, 0.5), (2, -0.125)]
    assert [(e.step, e.value) for e in accumulator.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.75)]
    (text_event,) = accumulator.Tensors("val/generations/text_summary")
    assert text_event.step == 2
    assert text_event.tensor_proto.string_val[0].decode() == \
        "| input | output | score |\n|---|---|---|\n| 1+1= | 2 | 1 |\n| 2+2= | 5 | 0 |"
    (config_event,) = accumulator.Tensors("config/text_summary")
    assert '"lr": 1e-06' in config_event.tensor_proto.string_val[0].decode()


def _wandb_records(run_file):
    """Records of a .wandb file: a 7-byte header, then LevelDB-log chunks in 32 KiB blocks, each a protobuf."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a chunk header is padding
            position += block - position % block
            continue
        _checksum, length, chunk_type = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and chunk_type == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if chunk_type in (1, 4):  # FULL or LAST chunk ends a record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_dir_holds_history_config_and_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    _run(["wandb"], tmp_path)
    (run_dir,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    (run_file,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    records = _wandb_records(run_file)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["actor/pg_loss"], h["critic/score/mean"]) for h in history[:2]] == \
        [(1, 0.5, 0.25), (2, -0.125, 0.75)]
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run_record.project, run_record.display_name) == ("proj", "exp")
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert config["trainer"] == {"total_epochs": 2, "logger": ["wandb"]}
    (table_file,) = glob.glob(os.path.join(run_dir, "files", "media", "table", "val", "generations_*.table.json"))
    with open(table_file) as f:
        assert json.load(f) == {"columns": ["step", "input", "output", "score"],
                                "data": [[2, "1+1=", "2", 1.0], [2, "2+2=", "5", 0.0]]}


def test_flatten_gives_the_key_paths_an_override_names_and_keeps_an_empty_dict():
    """mlflow's params and the dashboard's config diff: an empty dict (an unset engine_kwargs) is a value of its own,
    not a key that vanishes."""
    config = {"a": {"b": 1, "c": {}, "d": {"e": [1, 2]}}, "f": None}
    assert flatten(config) == {"a.b": 1, "a.c": {}, "a.d.e": [1, 2], "f": None}


def test_mlflow_file_store_holds_metrics_params_and_generations(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset below; restored after the test")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    tracker = Tracking("proj", "exp", ["mlflow"], config=CONFIG, local_dir=str(tmp_path))
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"  # mlflow 3 refuses a file store without it
    for step, metrics in STEP_METRICS.items():
        tracker.log(metrics, step=step)
    tracker.log({"val-core/gsm8k/acc@1": 0.5}, step=2)
    tracker.log_generations(SAMPLES, step=2)
    tracker.finish()

    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "actor/pg_loss")] == \
        [(1, 0.5), (2, -0.125)]
    assert run.data.metrics["val-core/gsm8k/acc_at_1"] == 0.5
    assert run.data.params == {"trainer.total_epochs": "2", "trainer.logger": "['wandb']", "actor.lr": "1e-06"}
    artifacts = run.info.artifact_uri.removeprefix("file://")
    with open(os.path.join(artifacts, "val_generations", "step_2.json")) as f:
        assert json.load(f)["data"] == [[2, "1+1=", "2", 1.0], [2, "2+2=", "5", 0.0]]
    with open(os.path.join(artifacts, "config.json")) as f:
        assert json.load(f) == CONFIG


def test_mlflow_respects_tracking_uri_from_environment(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    elsewhere = f"file://{tmp_path}/elsewhere"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", elsewhere)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tracker = Tracking("proj", "exp", ["mlflow"], local_dir=str(tmp_path / "local"))
    tracker.log({"loss": 1.5}, step=3)
    tracker.finish()
    assert not os.path.exists(tmp_path / "local" / "mlruns")
    client = MlflowClient(tracking_uri=elsewhere)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.data.metrics == {"loss": 1.5} and run.data.params == {}


def test_missing_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail as if not installed
    with pytest.raises(ImportError, match="trainer.logger 'wandb' needs the wandb package: pip install wandb"):
        Tracking("p", "e", ["wandb"], local_dir=str(tmp_path))


METRICS = {"critic/score/mean": 0.5, "critic/rewards/mean": 0.25, "response_length/mean": 37.5,
           "actor/ppo_kl": 0.00125, "actor/entropy": 2.5, "actor/pg_loss": -0.0625, "actor/grad_norm": 9.0,
           "timing_s/gen": 1.234, "timing_s/update_actor": 0.5, "timing_s/step": 2.0,
           "perf/total_num_tokens": 1000, "perf/max_memory_allocated_gb": 3.25}


def test_step_table_shows_headline_metrics_timings_and_memory():
    assert format_step_table(METRICS, 3, 10) == (
        "step 3/10 | score 0.5 | reward 0.25 | resp_len 37.5 | kl 0.00125 | entropy 2.5 | pg_loss -0.0625\n"
        "  time(s) | gen 1.23 | update_actor 0.50 | step 2.00\n"
        "  gpu mem(GB) | max_memory_allocated_gb 3.25")
    assert format_step_table({"critic/score/mean": 1.0}, 1, 2) == "step 1/2 | score 1"


def test_progress_bar_shows_step_time_tokens_per_second_and_counts_resumed_steps():
    out = io.StringIO()
    reporter = ProgressReporter(total_steps=10, initial_step=4, file=out)
    reporter.update(5, METRICS)
    reporter.update(6, {**METRICS, "timing_s/step": 4.0})
    reporter.close()
    text = out.getvalue()
    assert reporter.bar.n == 6
    assert "6/10" in text and "step_s=4.00" in text and "tok/s=250" in text  # 1000 tokens / 4 s
    assert text.count("step 5/10 | score 0.5") == 1 and "step 6/10 | score 0.5" in text
