"""benchmarks/vs_verl.py without a GPU: both command lines carry the same settings (verl's key only where the map says
so), hybridrl's side validates, and each trainer's JSON-lines format is read into per-step metrics."""
import argparse
import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def vs_verl():
    spec = importlib.util.spec_from_file_location("vs_verl", os.path.join(REPO, "benchmarks", "vs_verl.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_args(**changes):
    values = dict(data_dir="/data", tokenizer="/tok", shape="0.5b", gpus=1, prompts=64, n=8, prompt_length=256,
                  response_length=512, lr=1e-6, steps=5, padded=False, max_token_len=32768,
                  gpu_memory_utilization=0.5, trainers="verl,hybridrl", verl_transformers="image", timeout=540,
                  work_dir="/tmp/vs_verl_test")
    values.update(changes)
    return argparse.Namespace(**values)


def test_both_commands_carry_every_shared_setting(vs_verl):
    specs = vs_verl.commands(make_args(), "/model")
    verl_args, ours_args = specs["verl"]["argv"][3:], specs["hybridrl"]["argv"][3:]
    for key, value, verl_key, _ in vs_verl.settings(make_args(), "/model"):
        assert f"{key}={value}" in ours_args
        assert f"{verl_key or key}={value}" in verl_args
    # the only rows one side lacks are the documented ones
    ours_keys = {entry.split("=")[0] for entry in ours_args}
    verl_only = {entry.split("=")[0] for entry in verl_args} - ours_keys
    documented = {row[0] for row in vs_verl.only_verl(make_args(), "/r")} | {
        row[2] for row in vs_verl.settings(make_args(), "/model") if row[2]}
    assert verl_only == documented - ours_keys
    assert "+actor_rollout_ref.model.override_config.attn_implementation" in verl_only
    assert specs["verl"]["env"]["PYTHONPATH"].split(":")[0] == vs_verl.VERL_SITE
    assert vs_verl.VERL_SITE not in specs["hybridrl"]["env"]["PYTHONPATH"]


def test_shape_switches_offload_and_padding(vs_verl):
    rows = {key: value for key, value, _, _ in vs_verl.settings(make_args(shape="7b", padded=True), "/m")}
    assert rows["actor_rollout_ref.actor.fsdp_config.optimizer_offload"] == "true"
    assert rows["actor_rollout_ref.model.enable_gradient_checkpointing"] == "true"
    assert rows["actor_rollout_ref.model.use_remove_padding"] == "false"
    assert rows["actor_rollout_ref.actor.use_dynamic_bsz"] == "false"


def test_hybridrl_side_validates(vs_verl, capsys):
    vs_verl.check_hybridrl_overrides(vs_verl.commands(make_args(), "/model"))
    assert "composes and validates" in capsys.readouterr().out


def test_reads_both_metric_formats(vs_verl, tmp_path):
    verl_file, ours_file = tmp_path / "verl.jsonl", tmp_path / "ours.jsonl"
    verl_file.write_text("\n".join(json.dumps({"step": k, "data": {"timing_s/step": 10.0 + k,
                                                                   "actor/perf/max_memory_allocated_gb": 50.0 + k}})
                                   for k in (1, 2, 3)))
    ours_file.write_text("\n".join(json.dumps({"timing_s/step": 5.0 + k}) for k in (1, 2, 3)) + "\n")
    verl_steps = vs_verl.read_steps("verl", str(verl_file))
    ours_steps = vs_verl.read_steps("hybridrl", str(ours_file))
    assert [step["timing_s/step"] for step in verl_steps] == [11.0, 12.0, 13.0]
    assert vs_verl.mean_after_first(verl_steps)["timing_s/step"] == 12.5
    assert vs_verl.mean_after_first(ours_steps)["timing_s/step"] == 7.5
    # verl 0.9.1 logs the actor's peak memory as actor/perf/...: read under hybridrl's name, for the same column
    assert [step["perf/max_memory_allocated_gb"] for step in verl_steps] == [51.0, 52.0, 53.0]
    assert vs_verl.mean_after_first(verl_steps[:1]) == {}  # one step: nothing to set against later steps
