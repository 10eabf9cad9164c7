"""Issue 64, item 1 and item 5's silent data cases: every row of the data is checked before Ray starts, each problem
one line naming the file, the first rows and the count; what does not stop the run is a warning, once.

No Ray here (ray.init is made to fail). Lengths are compared with RLHFDataset's own prompt ids, the tokens the run
feeds the model.
"""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from hybridrl.config import ConfigError, check_before_start
from hybridrl.data import row_checks
from hybridrl.data.rl_dataset import RLHFDataset
from tests.test_preflight import config_for, inputs, rows  # noqa: F401  (inputs: the module-scoped fixture)


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the checks before start must not start Ray")

    monkeypatch.setattr(ray, "init", refuse)


def prompt(*messages):
    return [{"role": role, "content": content} for role, content in messages]


def write_rows(path, prompts, data_source="toy") -> str:
    """Rows in verl's layout with the given prompts (None: a null prompt), numbered question i otherwise."""
    table = pa.Table.from_pylist([
        {"data_source": data_source, "prompt": messages, "ability": "toy",
         "reward_model": {"style": "rule", "ground_truth": "a"}, "extra_info": {"index": index}}
        for index, messages in enumerate(prompts)])
    pq.write_table(table, str(path))
    return str(path)


def good(count):
    return [prompt(("user", f"question {i % 20}")) for i in range(count)]


def checked(inputs, tmp_path, *overrides):
    """(problems, warnings) of check_before_start with the row cache in tmp_path."""
    config = config_for(inputs, tmp_path, f"cache_dir={tmp_path / 'cache'}", "trainer.val_before_train=false",
                        "trainer.test_freq=-1", *overrides)
    try:
        return [], check_before_start(config)
    except ConfigError as err:
        return err.problems, []


def dataset_lengths(inputs, path, max_prompt_length=10_000):
    from transformers import AutoTokenizer

    config = {"prompt_key": "prompt", "max_prompt_length": max_prompt_length, "truncation": "error",
              "return_raw_chat": False, "return_full_prompt": False, "filter_overlong_prompts": False}
    dataset = RLHFDataset(path, AutoTokenizer.from_pretrained(inputs["model"]), config)
    return [len(dataset[index]["raw_prompt_ids"]) for index in range(len(dataset))]


def test_null_and_empty_prompts_are_named_with_file_row_and_count(inputs, tmp_path):
    prompts = good(300)
    prompts[200], prompts[250], prompts[7] = None, [], []
    path = write_rows(tmp_path / "train.parquet", prompts)
    problems, _ = checked(inputs, tmp_path, f"data.train_files={path}")
    assert problems == [f"data.train_files[0]: expected a non-empty list of messages in every row, got a null or "
                        f"empty prompt in 3 row(s) of '{path}', first rows 7, 200, 250"]


def test_unknown_role_is_refused(inputs, tmp_path):
    """`usr` would be rendered as a turn of its own by this template, and dropped by Qwen's: refused."""
    prompts = good(16)
    prompts[3] = prompt(("usr", "question 3"))
    prompts[9] = prompt(("system", "be brief"), ("User", "question 9"))
    path = write_rows(tmp_path / "train.parquet", prompts)
    problems, _ = checked(inputs, tmp_path, f"data.train_files={path}")
    assert problems == [f"data.train_files[0]: expected message roles among ['system', 'user', 'assistant', 'tool'], "
                        f"got ['User', 'usr'] in 2 row(s) of '{path}', first rows 3, 9"]


def test_prompt_with_only_empty_messages_is_refused_and_one_empty_message_warned(inputs, tmp_path):
    prompts = good(16)
    prompts[4] = prompt(("user", "  "))
    prompts[5] = prompt(("system", ""), ("user", "question 5"))
    path = write_rows(tmp_path / "train.parquet", prompts)
    problems, _ = checked(inputs, tmp_path, f"data.train_files={path}")
    assert problems == [f"data.train_files[0]: expected at least one message with content in every row, got only "
                        f"empty messages in 1 row(s) of '{path}', first rows 4"]
    prompts[4] = good(5)[4]
    write_rows(path, prompts)
    assert checked(inputs, tmp_path, f"data.train_files={path}") == ([], [
        f"data.train_files[0]: 1 row(s) of '{path}', first rows 5 have an empty message besides others (kept: the "
        f"chat template renders it as an empty turn, as verl does)"])


@pytest.fixture
def long_rows(inputs, tmp_path):
    """16 rows, rows 2 and 11 much longer than the rest; their lengths as the dataset measures them."""
    prompts = good(16)
    prompts[2] = prompt(("system", "question 1 " * 20), ("user", "question 2"))
    prompts[11] = prompt(("user", "question 11 " * 30))
    path = write_rows(tmp_path / "long.parquet", prompts)
    lengths = dataset_lengths(inputs, path)
    assert max(lengths[i] for i in range(16) if i not in (2, 11)) < 32 < min(lengths[2], lengths[11])
    return path, lengths


def test_overlong_prompt_with_truncation_error_is_refused_at_start(inputs, tmp_path, long_rows):
    """Before: the row failed only when its batch was drawn (index 200 at step 25 of 32)."""
    path, lengths = long_rows
    problems, _ = checked(inputs, tmp_path, f"data.train_files={path}", "data.max_prompt_length=32")
    assert problems == [
        f"data.train_files[0]: expected prompts of at most data.max_prompt_length=32 tokens (chat template applied) "
        f"with data.truncation='error', got 2 row(s) of '{path}', first rows 2, 11 (longest "
        f"{max(lengths)} tokens); raise data.max_prompt_length, or set data.truncation=left|right or "
        f"data.filter_overlong_prompts=true"]


@pytest.mark.parametrize("truncation, lost", [
    ("left", "their start: the system prompt and the first user header"),
    ("right", "their end: the end of the question and the assistant header the answer follows")])
def test_truncation_left_or_right_warns_once_with_what_it_drops(inputs, tmp_path, long_rows, truncation, lost):
    path, lengths = long_rows
    assert checked(inputs, tmp_path, f"data.train_files={path}", "data.max_prompt_length=32",
                   f"data.truncation={truncation}") == ([], [
        f"data.train_files[0]: data.truncation={truncation!r} cuts 2 row(s) of '{path}', first rows 2, 11 (longest "
        f"{max(lengths)} tokens) to data.max_prompt_length=32 tokens, dropping {lost}"])


def test_filter_overlong_prompts_warns_with_the_rows_it_drops(inputs, tmp_path, long_rows):
    path, lengths = long_rows
    assert checked(inputs, tmp_path, f"data.train_files={path}", "data.max_prompt_length=32",
                   "data.filter_overlong_prompts=true")[1] == [
        f"data.train_files[0]: data.filter_overlong_prompts=true drops 2 row(s) of '{path}', first rows 2, 11 "
        f"(longest {max(lengths)} tokens), longer than data.max_prompt_length=32"]


def test_prompt_longer_than_max_position_embeddings_is_refused(inputs, tmp_path, long_rows):
    path, lengths = long_rows
    model = tmp_path / "short_model"
    model.mkdir()
    for name in os.listdir(inputs["model"]):
        (model / name).symlink_to(os.path.join(inputs["model"], name))
    (model / "config.json").unlink()
    config = json.loads((inputs["root"] / "model" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 40}))
    problems, _ = checked(inputs, tmp_path, f"data.train_files={path}", f"actor_rollout_ref.model.path={model}",
                          "data.max_prompt_length=64", "data.truncation=left")
    assert problems == [
        f"data.train_files[0]: expected prompts within the model's max_position_embeddings=40 "
        f"(actor_rollout_ref.model.path's config.json), got 2 row(s) of '{path}', first rows 2, 11 "
        f"({min(64, max(lengths))} tokens as fed); lower data.max_prompt_length to at most 40"]


def test_data_source_without_a_scorer_is_refused_unless_a_custom_function_scores_all(inputs, tmp_path):
    path = write_rows(tmp_path / "train.parquet", good(16), data_source="my/unknown_task")
    problems, _ = checked(inputs, tmp_path, f"data.train_files={path}", "custom_reward_function.path=null")
    assert problems == [
        f"data.train_files[0]: expected a data_source (data_source, data.reward_fn_key) with a registered scorer "
        f"(hybridrl.reward.scorers.register_scorer), or custom_reward_function.path / rm_type to score every sample, "
        f"got 'my/unknown_task' in 16 row(s) of '{path}', first rows 0, 1, 2"]
    assert checked(inputs, tmp_path, f"data.train_files={path}") == ([], [])  # the custom function scores all
    gsm8k = write_rows(tmp_path / "gsm8k.parquet", good(16), data_source="openai/gsm8k")
    assert checked(inputs, tmp_path, f"data.train_files={gsm8k}", "custom_reward_function.path=null") == ([], [])


def test_lengths_match_the_dataset_in_worker_processes_and_are_cached_by_content(inputs, tmp_path, monkeypatch):
    """Three chunks in spawned workers give exactly the dataset's prompt lengths; a second check reads them from
    the cache; a change of the file's content measures again."""
    prompts = [prompt(("user", "question 1 " * (i % 7 + 1))) for i in range(50)]
    path = write_rows(tmp_path / "train.parquet", prompts)
    config = config_for(inputs, tmp_path, f"cache_dir={tmp_path / 'cache'}", f"data.train_files={path}")
    from hybridrl.models.config_checks import checked_policy_tokenizer

    tokenizer = checked_policy_tokenizer(config)
    monkeypatch.setattr(row_checks, "CHUNK_ROWS", 20)
    lengths, error = row_checks.prompt_lengths(path, config, tokenizer)
    assert (lengths.tolist(), error) == (dataset_lengths(inputs, path), None)
    assert len(os.listdir(tmp_path / "cache" / "row_lengths")) == 1

    def measured_again(*args):
        raise AssertionError("the cached lengths were not used")

    with monkeypatch.context() as patched:
        patched.setattr(row_checks, "_measure", measured_again)
        assert row_checks.prompt_lengths(path, config, tokenizer)[0].tolist() == lengths.tolist()
    write_rows(path, prompts[:49])
    assert len(row_checks.prompt_lengths(path, config, tokenizer)[0]) == 49
    assert len(os.listdir(tmp_path / "cache" / "row_lengths")) == 2
    assert np.array_equal(lengths[:49], row_checks.prompt_lengths(path, config, tokenizer)[0])


def test_rows_the_chat_template_raises_on_are_named_with_the_error(inputs, tmp_path):
    """A template that refuses a conversation (here: a system message) would raise when the row's batch is drawn."""
    prompts = good(16)
    prompts[6] = prompt(("system", "be brief"), ("user", "question 6"))
    path = write_rows(tmp_path / "train.parquet", prompts)
    template = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}"
                "{% endif %}{{ m.content }}{% endfor %}")
    problems, _ = checked(inputs, tmp_path, f"data.train_files={path}",
                          f"actor_rollout_ref.model.custom_chat_template=\"{template}\"")
    assert problems == [f"data.train_files[0]: expected prompts the chat template renders, got an error in 1 row(s) "
                        f"of '{path}', first rows 6 (row 6: TemplateError: no system role)"]


def test_eval_set_rows_are_checked_when_the_run_validates(inputs, tmp_path):
    prompts = good(4)
    prompts[1] = prompt(("usr", "question 1"))
    path = write_rows(tmp_path / "eval.parquet", prompts)
    eval_sets = f"data.eval_sets=[{{name: held_out, path: {path}}}]"
    config = config_for(inputs, tmp_path, f"cache_dir={tmp_path / 'cache'}", eval_sets)
    with pytest.raises(ConfigError) as caught:
        check_before_start(config)
    assert caught.value.problems == [
        f"data.eval_sets[0].path: expected message roles among ['system', 'user', 'assistant', 'tool'], got "
        f"['usr'] in 1 row(s) of '{path}', first rows 1"]
    assert check_before_start(config_for(inputs, tmp_path, f"cache_dir={tmp_path / 'cache'}", eval_sets,
                                         "trainer.val_before_train=false", "trainer.test_freq=-1")) == []
