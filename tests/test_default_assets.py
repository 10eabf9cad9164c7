"""The embedded default: prepared once, reused after, rebuilt (with a clear line) when damaged or of another recipe."""
import contextlib
import io
import json
import os

import pyarrow.parquet as pq
import pytest
import safetensors.torch
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridrl.config import compose_config, validate_config
from hybridrl.defaults import assets
from hybridrl.defaults.assets import (MARKER_FILE, DefaultRecipe, default_paths, ensure_default_assets,
                                      prepare_default_assets, sft_rows_from_rl)

SMALL = DefaultRecipe(
    train_size=120, test_size=40, vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
    intermediate_size=64,
    # one SFT rank: what is tested here is the preparation around the launch (tests/test_sft_trainer.py launches 2)
    sft_overrides={"trainer.total_training_steps": 6, "trainer.total_epochs": 1, "data.train_batch_size": 16,
                   "data.micro_batch_size_per_gpu": 8, "trainer.device": "cpu", "trainer.n_gpus_per_node": 1})


def prepare(cache_dir, recipe=SMALL, with_model=True):
    """Run prepare_default_assets and return (paths, its [hybridrl] lines)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        paths = prepare_default_assets(str(cache_dir), recipe, with_model=with_model)
    lines = [line for line in out.getvalue().splitlines() if line.startswith("[hybridrl]")]
    return paths, lines


def file_times(root):
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, files in os.walk(root) for f in files}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("cache")
    paths, lines = prepare(cache_dir)
    return cache_dir, paths, lines


def test_first_run_prepares_every_stage_with_a_log_line(prepared):
    cache_dir, paths, lines = prepared
    assert [line.split(":")[0] for line in lines if "preparing" in line] == [
        "[hybridrl] preparing data", "[hybridrl] preparing tiny model", "[hybridrl] preparing SFT warm start"]
    assert [line.split(" in ")[0] for line in lines if "prepared" in line] == [
        "[hybridrl] prepared data", "[hybridrl] prepared tiny model", "[hybridrl] prepared SFT warm start"]
    assert paths == default_paths(str(cache_dir))
    train = pq.read_table(paths.train_file).to_pylist()
    test = pq.read_table(paths.val_file).to_pylist()
    assert len(train) == 120 and 0 < len(test) <= 40
    assert not {row["prompt"][0]["content"] for row in test} & {row["prompt"][0]["content"] for row in train}
    assert train[0]["data_source"] == "reasoning_gym/decimal_chain_sum"
    sft = pq.read_table(paths.sft_train_file).column("messages").to_pylist()
    assert [messages[:-1] for messages in sft] == [row["prompt"] for row in train]
    tagged = [m[-1]["content"] == f"<answer>{row['reward_model']['ground_truth']}</answer>" for m, row in zip(sft, train)]
    assert tagged == [False, False, False, False, True] * 24  # tagged_fraction 0.2: one row in five, spread evenly
    model = AutoModelForCausalLM.from_pretrained(paths.sft_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(paths.sft_model_dir)
    assert model.config.hidden_size == 32 and model.config.vocab_size == len(tokenizer)
    with open(os.path.join(paths.sft_model_dir, "sft_metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, 7))
    for stage_dir in (paths.data_dir, paths.init_model_dir, paths.sft_model_dir):
        assert os.path.isfile(os.path.join(stage_dir, MARKER_FILE))
        assert not [name for name in os.listdir(os.path.dirname(stage_dir)) if ".building-" in name or ".run" in name]


# What reusing must never call: a stage's build, or a loader of a model, tokenizer, weights or whole table (the
# checks read headers, JSON files and parquet footers only). That is what keeps a reuse at a fraction of a second.
NOT_WHILE_REUSING = [(assets, "_build_data"), (assets, "_build_init_model"), (assets, "_build_sft_model"),
                     *[(loader, "from_pretrained") for loader in (
                         transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer,
                         transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase)],
                     (torch, "load"), (safetensors.torch, "load_file"), (pq, "read_table")]


def test_second_run_reuses_everything_without_touching_a_file(prepared, monkeypatch):
    """Nothing rebuilt (no file touched) and nothing loaded (every loader refused here): the reasons a reuse is
    fast, checked as calls rather than as seconds, which a loaded machine could stretch."""
    cache_dir, paths, _ = prepared
    before = file_times(cache_dir)
    called = []
    for owner, name in NOT_WHILE_REUSING:
        def refused(*args, _what=f"{getattr(owner, '__name__', owner)}.{name}", **kwargs):
            called.append(_what)
            raise AssertionError(f"reusing called {_what}")
        monkeypatch.setattr(owner, name, refused)
    _, lines = prepare(cache_dir)
    assert called == [], f"reusing rebuilt or loaded something: {called}"
    assert lines == [f"[hybridrl] reusing data in {paths.data_dir}",
                     f"[hybridrl] reusing tiny model in {paths.init_model_dir}",
                     f"[hybridrl] reusing SFT warm start in {paths.sft_model_dir}"]
    assert file_times(cache_dir) == before


def test_damaged_model_dirs_are_named_and_rebuilt(prepared):
    cache_dir, paths, _ = prepared
    weights = os.path.join(paths.init_model_dir, "model.safetensors")
    full_size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(full_size // 2)
    os.remove(os.path.join(paths.sft_model_dir, "config.json"))
    data_times = file_times(paths.data_dir)
    _, lines = prepare(cache_dir)
    assert lines[0] == f"[hybridrl] reusing data in {paths.data_dir}"
    assert lines[1] == (f"[hybridrl] tiny model in {paths.init_model_dir} is unusable (model.safetensors is "
                        f"{full_size // 2} bytes, its header describes {full_size} (truncated or damaged)); rebuilding it")
    assert f"[hybridrl] SFT warm start in {paths.sft_model_dir} is unusable (config.json is missing); rebuilding it" \
        in lines
    assert file_times(paths.data_dir) == data_times
    assert os.path.getsize(weights) == full_size
    AutoModelForCausalLM.from_pretrained(paths.sft_model_dir)


def test_unfinished_or_other_recipe_data_is_rebuilt(tmp_path):
    paths, _ = prepare(tmp_path, with_model=False)
    os.remove(os.path.join(paths.data_dir, MARKER_FILE))  # as if the process died before the marker
    _, lines = prepare(tmp_path, with_model=False)
    assert lines[0] == (f"[hybridrl] data in {paths.data_dir} is unusable (no {MARKER_FILE}: its preparation did not "
                        "finish, or it was made by hand); rebuilding it")
    bigger = DefaultRecipe(**{**SMALL.__dict__, "train_size": 130})
    _, lines = prepare(tmp_path, recipe=bigger, with_model=False)
    assert lines[0] == (f"[hybridrl] data in {paths.data_dir} is unusable (built with another recipe: train_size "
                        "differ); rebuilding it")
    assert pq.read_metadata(paths.train_file).num_rows == 130


def test_ensure_default_assets_prepares_only_what_the_config_uses(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("hybridrl.defaults.assets.prepare_default_assets",
                        lambda cache_dir, with_model: calls.append((cache_dir, with_model)))
    default = validate_config(compose_config([f"cache_dir={tmp_path}"]))
    own_model = validate_config(compose_config([f"cache_dir={tmp_path}", "actor_rollout_ref.model.path=/my/model"]))
    own_everything = validate_config(compose_config([
        f"cache_dir={tmp_path}", "actor_rollout_ref.model.path=/my/model", "data.train_files=/my/train.parquet",
        "data.val_files=/my/test.parquet"]))
    for config in (default, own_model, own_everything):
        ensure_default_assets(config)
    assert calls == [(str(tmp_path), True), (str(tmp_path), False)]


def test_sft_rows_tag_exactly_the_asked_fraction_evenly():
    rl_rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": str(i)}}
               for i in range(8)]
    contents = [row["messages"][-1]["content"] for row in sft_rows_from_rl(rl_rows, 0.25)]
    assert contents == ["The answer is 0.", "The answer is 1.", "The answer is 2.", "<answer>3</answer>",
                        "The answer is 4.", "The answer is 5.", "The answer is 6.", "<answer>7</answer>"]
    assert all(r["messages"][-1]["content"].startswith("<answer>") for r in sft_rows_from_rl(rl_rows, 1.0))
    assert not any(r["messages"][-1]["content"].startswith("<answer>") for r in sft_rows_from_rl(rl_rows, 0.0))
    with pytest.raises(ValueError, match=r"tagged_fraction must be in \[0, 1\], got 1.5"):
        sft_rows_from_rl(rl_rows, 1.5)
