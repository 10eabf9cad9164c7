"""Named eval sets with their own sampling (issue #15 point 7): config checks, metrics by hand, sampling overrides
in the engines, and a real CPU validation (2 gloo ranks, HF rollout) of the toy task with two eval sets."""
import json

import numpy as np
import pytest
import torch

from hybridrl.agent_loop.manager import rollout_sampling_params
from hybridrl.config import compose_config, validate_config
from hybridrl.config.validation import ConfigError
from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.evaluation import (EvalSet, ValidationResults, eval_set_metrics, eval_sets_from_config,
                                             truncated_responses)
from hybridrl.trainer.ppo.metric_utils import compute_validation_metrics
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer, _val_score
from hybridrl.workers.rollout.sampling import max_new_tokens, sampling_source
from tests.test_e2e_training import fit_once, make_config, read_metrics

EOS = 2


# ---------------------------------------------------------------------------------------------- config

def test_eval_sets_default_to_val_kwargs_and_the_rollout_length():
    config = validate_config(compose_config([
        "data.eval_sets=[{name: aime, path: a.parquet, n_samples_per_prompt: 4, temperature: 0.6}, "
        "{name: short, path: [b.parquet, c.parquet], max_response_length: 4, do_sample: true}]"]))
    aime, short = eval_sets_from_config(config)
    val_kwargs = config.actor_rollout_ref.rollout.val_kwargs
    assert aime == EvalSet("aime", ("a.parquet",), 4, val_kwargs.do_sample, 0.6, val_kwargs.top_p, val_kwargs.top_k,
                           config.actor_rollout_ref.rollout.response_length, -1)
    assert short.files == ("b.parquet", "c.parquet") and short.max_response_length == 4 and short.do_sample
    assert short.sampling_overrides() == {"temperature": val_kwargs.temperature, "top_p": val_kwargs.top_p,
                                          "top_k": val_kwargs.top_k, "max_tokens": 4}


def test_bad_eval_sets_are_refused_naming_the_key():
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config([
            "data.eval_sets=[{name: 'a b', path: a.parquet}, {name: x, path: a.parquet, top_p: 0, seed: 1}, "
            "{name: x, path: a.parquet, max_response_length: 999}, {path: a.parquet}]"]))
    problems = error.value.problems
    for expected in ("data.eval_sets[0].name: expected a name of letters", "data.eval_sets[1]: expected keys among",
                     "data.eval_sets[1].top_p: expected a number in (0, 1]",
                     "data.eval_sets[2].name: expected a name no other eval set has",
                     "data.eval_sets[2].max_response_length: expected an integer in [1, "
                     "actor_rollout_ref.rollout.response_length=16]", "data.eval_sets[3].name: expected"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)


def test_validation_without_any_set_is_refused():
    with pytest.raises(ConfigError, match=r"data.val_files: expected at least one .parquet file"):
        validate_config(compose_config(["data.val_files=[]", "trainer.val_before_train=true"]))
    validate_config(compose_config(["data.val_files=[]", "data.eval_sets=[{name: a, path: a.parquet}]"]))


def test_summary_metric_must_be_a_metric_that_validation_logs():
    sets = "data.eval_sets=[{name: held_out, path: a.parquet}]"
    for metric in ("eval/held_out", "eval/held_out/acc", "eval/held_out-truncated_ratio", "val-aux/acc/mean@1"):
        validate_config(compose_config([sets, f"trainer.summary_metric={metric}"]))
    for metric in ("eval/heldout/acc", "reward/acc/mean", "val-core"):
        with pytest.raises(ConfigError) as error:
            validate_config(compose_config([sets, f"trainer.summary_metric={metric}"]))
        assert error.value.problems == [
            "trainer.summary_metric: expected a validation metric, val-core/..., val-aux/... or eval/<a name of "
            f"data.eval_sets: ['held_out']>[/...], got {metric!r}"]


def test_summary_score_is_the_named_metric_or_the_mean_of_val_core():
    metrics = {"val-core/a/reward/mean@1": 0.2, "val-core/b/reward/mean@1": 0.6, "eval/held_out/acc": 0.25}
    assert _val_score(metrics, None) == pytest.approx(0.4)
    assert _val_score(metrics, "eval/held_out/acc") == 0.25
    with pytest.raises(ValueError, match=r"trainer.summary_metric: expected one of this validation's metrics, got "
                                         r"'eval/held_out/last_number_right'; it logged \['eval/held_out/acc', "):
        _val_score(metrics, "eval/held_out/last_number_right")


# ---------------------------------------------------------------------------------------------- metrics by hand

def scored_batch(responses, lengths, sources, scores, prompt_width=2):
    """Rows of right-padded responses (pad 0) with their valid lengths, and the reward manager's dict."""
    width = max(len(r) for r in responses)
    padded = torch.tensor([r + [0] * (width - len(r)) for r in responses])
    attention = torch.cat([torch.ones(len(responses), prompt_width, dtype=torch.long),
                           (torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)).long()], dim=1)
    batch = DataProto.from_dict({"prompts": torch.full((len(responses), prompt_width), 5), "responses": padded,
                                 "attention_mask": attention},
                                non_tensors={"data_source": np.array(sources, dtype=object)})
    reward_tensor = torch.zeros(len(responses), width)
    reward_tensor[:, 0] = torch.tensor(scores)
    return batch, {"reward_tensor": reward_tensor, "reward_metrics": {"reward/errors": 1.0},
                   "reward_extra_info": {"acc": [s > 0 for s in scores]}}


class Tok:
    eos_token_id = EOS

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return " ".join(map(str, ids.tolist()))


def test_truncated_means_the_cap_reached_without_an_eos():
    batch, _ = scored_batch([[7, 7, 7], [7, 7, EOS], [7, EOS, 0], [7, 0, 0]], [3, 3, 2, 1], ["s"] * 4, [0] * 4)
    assert truncated_responses(batch, 3, EOS).tolist() == [True, False, False, False]
    assert truncated_responses(batch, 1, EOS).tolist() == [True, False, False, True]  # a cap of 1: row 3 is cut


def test_eval_set_metrics_by_hand():
    metrics = eval_set_metrics("aime", torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([True, False, False, True]),
                               torch.tensor([3, 1, 2, 3]))
    assert metrics == {"eval/aime": 0.75, "eval/aime-truncated_ratio": 0.5, "eval/aime/response_len/mean": 2.25,
                       "eval/aime/response_len/max": 3.0}


def test_without_eval_sets_the_metrics_are_the_plain_validation_ones():
    """The plain set alone gives exactly what _validate gave before eval sets existed."""
    first = scored_batch([[7, EOS], [7, 7]], [2, 2], ["a", "b"], [1.0, 0.0])
    second = scored_batch([[7, 7]], [2], ["a"], [0.5])
    results = ValidationResults(Tok(), "data_source")
    for batch, reward in (first, second):
        results.add(batch, reward, n=1)
    expected = compute_validation_metrics(np.array(["a", "b", "a"], dtype=object), torch.tensor([1.0, 0.0, 0.5]), n=1,
                                          extra={"acc": [True, False, True]})
    expected["val-aux/reward/errors"] = 2.0
    assert results.metrics() == expected
    assert list(results.metrics()) == list(expected)
    assert [sample[2] for sample in results.samples] == [1.0, 0.0, 0.5]


def test_eval_sets_pool_val_core_by_n_and_add_their_own_keys():
    plain = scored_batch([[7, EOS]], [2], ["a"], [1.0])
    greedy = scored_batch([[7, 7], [7, EOS]], [2, 2], ["a", "a"], [0.0, 0.0])
    sampled = scored_batch([[7, 7], [7, 7], [EOS, 0]], [2, 2, 1], ["a", "a", "a"], [1.0, 0.0, 1.0])
    short = EvalSet("short", ("x",), 1, False, 0.0, 1.0, -1, 2, -1)
    many = EvalSet("many", ("x",), 3, True, 1.0, 1.0, -1, 2, -1)
    results = ValidationResults(Tok(), "data_source")
    results.add(*plain, n=1)
    results.add(*greedy, n=1, eval_set=short)
    results.add(*sampled, n=3, eval_set=many)
    metrics = results.metrics()
    assert metrics["val-core/a/reward/mean@1"] == pytest.approx(1 / 3)  # plain and short pooled: (1 + 0 + 0) / 3
    assert metrics["val-core/a/reward/mean@3"] == pytest.approx(2 / 3)
    assert metrics["val-aux/reward/errors"] == 3.0
    assert metrics["eval/short"] == 0.0 and metrics["eval/short-truncated_ratio"] == 0.5
    assert metrics["eval/many"] == pytest.approx(2 / 3)
    assert metrics["eval/many-truncated_ratio"] == pytest.approx(2 / 3)
    assert metrics["eval/many/response_len/mean"] == pytest.approx(5 / 3)
    # the reward extras of each set under its own name (acc: score > 0), besides val-aux's pool of all sets
    assert (metrics["eval/short/acc"], metrics["eval/many/acc"]) == (0.0, pytest.approx(2 / 3))
    assert metrics["val-aux/acc/mean@1"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------------------------------------- engines' sampling

def test_sampling_overrides_replace_val_kwargs_only_when_given():
    rollout = validate_config(compose_config([])).actor_rollout_ref.rollout
    assert sampling_source(rollout, {"validate": True}) is rollout.val_kwargs  # unchanged without overrides
    assert max_new_tokens(rollout, {"validate": True}) == rollout.response_length
    meta = {"validate": True, "sampling_overrides": {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 4}}
    source = sampling_source(rollout, meta)
    assert (source.temperature, source.top_p, source.top_k) == (0.7, 0.9, 5)
    assert max_new_tokens(rollout, meta) == 4
    params = rollout_sampling_params(rollout, validate=True, do_sample=True, overrides=meta["sampling_overrides"])
    assert (params["temperature"], params["top_p"], params["top_k"], params["max_tokens"]) == (0.7, 0.9, 5, 4)
    assert "max_tokens" not in rollout_sampling_params(rollout, validate=True, do_sample=True)
    with pytest.raises(ValueError, match="max_tokens=99: expected 1..rollout.response_length=16"):
        max_new_tokens(rollout, {"sampling_overrides": {"max_tokens": 99}})


# ---------------------------------------------------------------------------------------------- a real validation

def test_validation_runs_each_eval_set_with_its_own_sampling(ray_local, toy_task, tmp_path):
    """Plain set: greedy, 8 tokens. "short": the same prompts greedy with at most 3 tokens, so each response is the
    plain one's first 3 tokens. "sampled": 3 samples per prompt at temperature 1."""
    config = make_config(toy_task, str(tmp_path), "trainer.val_before_train=true",
                         f"data.eval_sets=[{{name: short, path: {toy_task['val']}, max_response_length: 3}}, "
                         f"{{name: sampled, path: {toy_task['val']}, n_samples_per_prompt: 3, do_sample: true, "
                         f"temperature: 1.0}}]")
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    scored = []
    score = trainer._score
    trainer._score = lambda batch, reward_fn: scored.append((batch, score(batch, reward_fn))) or scored[-1][1]
    try:
        metrics = trainer._validate()
    finally:
        trainer.shutdown()
    (plain, plain_reward), (short, short_reward), (sampled, sampled_reward) = scored

    def rows(batch):
        width = batch.batch["responses"].shape[1]
        lengths = batch.batch["attention_mask"][:, -width:].sum(-1).tolist()
        return [row[:length].tolist() for row, length in zip(batch.batch["responses"], lengths)]

    assert len(rows(plain)) == len(rows(short)) == 8 and len(rows(sampled)) == 24
    assert max(map(len, rows(plain))) > 3, "the plain set's responses should run past 3 tokens"
    assert [r[:3] for r in rows(plain)] == rows(short)  # greedy, cut at the set's own length
    groups = [rows(sampled)[i:i + 3] for i in range(0, 24, 3)]
    assert any(len({tuple(r) for r in group}) > 1 for group in groups), "temperature 1 gave identical samples"

    eos = trainer.tokenizer.eos_token_id
    short_scores = short_reward["reward_tensor"].sum(-1)
    assert metrics["eval/short"] == pytest.approx(short_scores.mean().item())
    assert metrics["eval/short-truncated_ratio"] == pytest.approx(
        np.mean([len(r) == 3 and r[-1] != eos for r in rows(short)]))
    assert metrics["eval/short/response_len/max"] <= 3
    assert metrics["eval/sampled"] == pytest.approx(sampled_reward["reward_tensor"].sum(-1).mean().item())
    pooled = torch.cat([plain_reward["reward_tensor"].sum(-1), short_scores])
    assert metrics["val-core/toy/letter_a/reward/mean@1"] == pytest.approx(pooled.mean().item())
    assert metrics["val-core/toy/letter_a/reward/mean@3"] == pytest.approx(metrics["eval/sampled"])


def test_summary_json_leads_with_the_metric_that_trainer_summary_metric_names(ray_local, toy_task, tmp_path):
    """A recipe names its headline; summary.json starts with that name and holds that metric's values, not the mean of
    val-core/. Here the "short" set's response length: 3 tokens (its cap; the toy model never stops that early),
    where the untrained toy model's scores are all 0."""
    config = make_config(toy_task, str(tmp_path), "trainer.val_before_train=true", "trainer.val_only=true",
                         f"data.eval_sets=[{{name: short, path: {toy_task['val']}, max_response_length: 3}}]",
                         "trainer.summary_metric=eval/short/response_len/mean")
    fit_once(RayPPOTrainer(config))
    (logged,) = read_metrics(str(tmp_path))
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert next(iter(summary)) == "val_score_metric" and summary["val_score_metric"] == "eval/short/response_len/mean"
    assert summary["val_score_before"] == summary["val_score_after"] == logged["eval/short/response_len/mean"] == 3.0
    assert logged["val-core/toy/letter_a/reward/mean@1"] != 3.0  # the default score would differ
