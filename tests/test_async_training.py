"""Disaggregated and asynchronous training end to end: real local Ray, 2 CPU processes (one trainer rank, one
rollout rank serving the HF engine server), weights over a real gloo group, the toy task of test_e2e_training
(reward = share of the letter "a" in the response)."""
import collections
import os
import threading

import pytest
import torch

from hybridrl.data.batch_layout import WEIGHT_VERSIONS_KEY
from hybridrl.trainer.ppo.checkpointing import DATA_STATE_FILE
from hybridrl.trainer.ppo.placement import SeparatePool, actor_version
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from hybridrl.trainer.ppo.schedule import FullyAsync, Sync
from hybridrl.trainer.checkpoint_dir import step_dir_name
from tests.test_e2e_training import fit_once, make_config, read_metrics

SPLIT = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
         "actor_rollout_ref.rollout.agent.num_workers=1", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"]


def recording(cls, stop_after: int | None = None):
    """`cls` that also records each step's batch as learn_step gets it (`learned`), its trained prompts (extra_info
    index, one per group) and every prompt it took from the data; with stop_after, it is asked to stop after that step (as SIGTERM does: the driver's
    RunControl), and so saves a checkpoint with what is in flight then."""

    class Recording(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.learned: list = []  # each step's batch, as learn_step gets it
            self.trained_prompts: list[list[int]] = []
            self.taken_prompts: list[int] = []
            batches = self.prompt_source.batches  # every step takes its batches through the prompt source
            self.prompt_source.batches = lambda: self._record(batches())

        def _record(self, batches):
            for batch in batches:
                self.taken_prompts += [info["index"] for info in batch["extra_info"]]
                yield batch

        def _stop_requested(self):
            return stop_after is not None and self.global_steps >= stop_after

        def learn_step(self, batch, timing, metrics):
            self.learned.append(batch)
            by_uid = {uid: info["index"] for uid, info in zip(batch.non_tensor_batch["uid"],
                                                              batch.non_tensor_batch["extra_info"])}
            self.trained_prompts.append(sorted(by_uid.values()))
            return super().learn_step(batch, timing, metrics)

    return Recording


def train(config, stop_after: int | None = None):
    """The run, and the prompts its prompt source holds at the end (buffer and rows not yet made groups), once what
    the schedule had in flight went back to it as a checkpoint would put it."""
    trainer = recording(RayPPOTrainer, stop_after)(config)
    trainer.init_workers()
    try:
        trainer.fit()
        trainer.schedule.return_in_flight()
        held = prompts_held(trainer.prompt_source.state_dict())
        if isinstance(trainer.placement, SeparatePool):
            trainer.versions_at_end = (trainer.placement.rollout_version, actor_version(trainer.actor_rollout_wg))
    finally:
        trainer.shutdown()
    return trainer, held


@pytest.mark.slow
def test_disaggregated_engines_generate_from_the_trainers_current_weights(ray_local, toy_task, tmp_path):
    """Separate pools, synchronous schedule: after every update the rollout's engine holds exactly the trainer's
    weights (its log-probs of its own samples equal the trainer's), and knows their version. The trainer pool's
    worker is actor + reference (role actor_ref: a KL loss)."""
    config = make_config(toy_task, str(tmp_path), *SPLIT, "actor_rollout_ref.rollout.calculate_log_probs=true",
                         "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=3",
                         "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01")
    trainer, _ = train(config)
    assert (type(trainer.placement), type(trainer.schedule)) == (SeparatePool, Sync)
    metrics = read_metrics(str(tmp_path))
    assert [m["weight_sync/megabytes"] > 0 for m in metrics[1:]] == [True, True]  # a push before steps 2 and 3
    for m in metrics:  # stale weights (lr 1e-2) would show as a difference of several percent
        assert m["training/rollout_probs_diff_max"] < 1e-4, m["training/rollout_probs_diff_max"]
    assert metrics[-1]["actor/kl_loss"] > 0  # the reference is the initial policy, the actor has moved
    assert trainer.versions_at_end == (3, 3)  # the engine got the last update too (validation at the end)


@pytest.mark.slow
def test_the_data_flow_runs_on_a_separate_rollout_pool(ray_local, toy_task, tmp_path):
    """Separate pools, synchronous schedule, the data flow (groups scored as they finish, over-sampled and filtered):
    every trained token comes from the weights the trainer had at that step, which the rollout pool's engine got
    before generating (its log-probs equal the trainer's), and the data_flow/* counts are logged every step."""
    config = make_config(toy_task, str(tmp_path), *SPLIT, "actor_rollout_ref.rollout.calculate_log_probs=true",
                         "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=3",
                         "data_flow.enable=true", "data_flow.over_sampling_batch_size=12",
                         "data_flow.dynamic_sampling_filter.name=check_reward_nonzero_std")
    batches = {}

    class Keeping(RayPPOTrainer):
        def learn_step(self, batch, timing, metrics):
            batches[self.global_steps] = batch
            return super().learn_step(batch, timing, metrics)

    trainer = Keeping(config)
    trainer.init_workers()
    try:
        trainer.fit()
        assert (trainer.placement.rollout_version, actor_version(trainer.actor_rollout_wg)) == (3, 3)
    finally:
        trainer.shutdown()
    assert (type(trainer.placement), type(trainer.schedule)) == (SeparatePool, Sync)
    metrics = read_metrics(str(tmp_path))
    assert [m["weight_sync/megabytes"] > 0 for m in metrics[1:]] == [True, True]
    for step, m in enumerate(metrics, start=1):
        assert m["data_flow/num_groups_trained"] == config.data.train_batch_size
        assert m["data_flow/num_gen_batches"] >= 1 and "data_flow/num_dropped_groups" in m
        assert m["training/rollout_probs_diff_max"] < 1e-4, m["training/rollout_probs_diff_max"]
        batch = batches[step]
        generated = batch.batch["response_mask"].bool()
        assert (batch.batch[WEIGHT_VERSIONS_KEY][generated] == step - 1).all()


def stop_and_resume(toy_task, tmp_path, *overrides):
    """A 4-step run stopped after step 2 (as SIGTERM stops it: its checkpoint holds what is in flight in the prompt
    source's buffer), then resumed. Checks that every prompt taken from the data is trained once or still held by
    the prompt source, and that the four steps train as many groups as an uninterrupted run; returns (first, second)
    trainers, the prompts the checkpoint held (in its order) and the metrics of the four steps."""
    overrides = [*SPLIT, *overrides, "trainer.save_freq=10", "trainer.total_training_steps=4", "trainer.test_freq=-1"]
    first, held_first = train(make_config(toy_task, str(tmp_path), *overrides), stop_after=2)
    data_file = os.path.join(tmp_path, step_dir_name(2), DATA_STATE_FILE)
    saved = torch.load(data_file, weights_only=True)
    assert "in_flight" not in saved  # the work in flight is in one place: the prompt source's buffer
    saved_prompts = prompts_held(saved["prompt_source"])
    assert saved_prompts, "a checkpoint of an asynchronous run with nothing in flight tests nothing"
    assert held_first == saved_prompts
    trained_first = [index for step in first.trained_prompts for index in step]
    assert collections.Counter(first.taken_prompts) == collections.Counter(trained_first + saved_prompts)

    second, held_second = train(make_config(toy_task, str(tmp_path), *overrides))
    assert second.global_steps == 4 and len(second.trained_prompts) == 2
    trained_second = [index for step in second.trained_prompts for index in step]
    # nothing lost, nothing trained twice: what the resumed run had (saved + newly taken) = trained + held
    assert collections.Counter(saved_prompts + second.taken_prompts) == collections.Counter(
        trained_second + held_second)
    assert len(trained_first) + len(trained_second) == 4 * 8  # the uninterrupted run's groups: 4 steps x 8
    metrics = {int(m["training/global_step"]): m for m in read_metrics(str(tmp_path))}  # the resumed run's last
    return first, second, saved_prompts, [metrics[step] for step in (1, 2, 3, 4)]


@pytest.mark.slow
def test_one_step_off_trains_every_group_one_version_old_and_resumes_the_groups_generated_ahead(ray_local, toy_task,
                                                                                                tmp_path):
    """one_step_off, no filter: the data flow trains every prompt's group, 8 a step in the data's order, each one
    version old from step 2 on; the checkpoint after step 2 waits for step 3's groups (generated with version 1)
    and saves them first in the buffer, and the resumed run trains them first, not generated again."""
    first, second, saved_prompts, metrics = stop_and_resume(
        toy_task, tmp_path, "async_training.mode=one_step_off", "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.actor.optim.lr=1e-2")
    taken = first.taken_prompts + second.taken_prompts
    assert first.trained_prompts + second.trained_prompts == [sorted(taken[8 * k:8 * k + 8]) for k in range(4)]
    assert second.trained_prompts[0] == sorted(saved_prompts)  # the groups generated ahead of the stop
    ahead = saved_prompt_source(tmp_path, 2)["buffer"]  # step 3's groups, generated with the weights of version 1
    assert len(ahead) == 8 and all(sample["status"] in ("completed", "truncated") and sample["reward"] is not None
                                   for group in ahead for sample in group)
    assert {version for group in ahead for sample in group for version in sample["token_versions"]
            if version >= 0} == {1}
    assert [(m["async_training/staleness/min"], m["async_training/staleness/max"]) for m in metrics] == [
        (0, 0), (1, 1), (1, 1), (1, 1)]
    # the version each update starts from counts the steps before it, across the resume after step 2
    assert [m["async_training/policy_version"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics:  # every group kept and trained, none aborted: the batch path's samples
        assert (m["data_flow/num_groups_trained"], m["data_flow/num_gen_batches"]) == (8, 1)
        assert (m["data_flow/num_dropped_groups"], m["data_flow/num_aborted_groups"]) == (0, 0)
    diffs = [m["training/rollout_probs_diff_max"] for m in metrics]
    assert diffs[0] < 1e-4 and min(diffs[1:]) > 1e-3, diffs  # the engine's weights were one update old (lr 1e-2)


@pytest.mark.slow
def test_fully_async_never_exceeds_the_staleness_bound_and_resumes_what_was_in_flight(ray_local, toy_task,
                                                                                      tmp_path):
    """fully_async, no filter, max_staleness 0: every step trains 8 groups none of them stale; groups generated
    while an update trained went stale and came back (requeued), none lost; the stream keeps (0 + 1) x 8 ahead."""
    first, second, _, metrics = stop_and_resume(toy_task, tmp_path, "async_training.mode=fully_async",
                                                "async_training.max_staleness=0",
                                                "async_training.stale_samples=requeue")
    assert [m["async_training/staleness/max"] for m in metrics] == [0] * 4
    assert sum(m["async_training/requeued_groups"] for m in metrics) > 0
    for m in metrics:
        assert (m["async_training/dropped_groups"], m["data_flow/num_dropped_groups"]) == (0, 0)
        assert (m["data_flow/num_groups_trained"], m["async_training/groups_ahead"]) == (8, 8)


@pytest.mark.slow
def test_one_step_off_scores_with_a_reward_model_on_the_main_thread_when_a_step_takes_its_groups(ray_local, toy_task,
                                                                                                tmp_path):
    """one_step_off with a reward model (on the trainer pool's rank; the rule scorer gives 0): the groups generated
    ahead are scored when their step takes them, in one reward-model call a step on the controller's main thread,
    never on the generating thread while the rank updates; each trained sample's score is the model's own output on
    its prompt + response, and the schedule's staleness is kept."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from test_scale_features_e2e import save_reward_model, score_at_last_token

    rm_dir = save_reward_model(tmp_path / "rm", AutoTokenizer.from_pretrained(toy_task["model"]))
    zero = tmp_path / "zero.py"
    zero.write_text("def zero(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    run_dir = str(tmp_path / "run")
    config = make_config(toy_task, run_dir, *SPLIT, "async_training.mode=one_step_off", "reward_model.enable=true",
                         f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=4",
                         f"custom_reward_function.path={zero}", "custom_reward_function.name=zero",
                         "trainer.total_training_steps=3", "trainer.test_freq=-1")
    scored_on = []

    class Spying(recording(RayPPOTrainer)):
        def _score(self, batch, reward_fn):
            scored_on.append((threading.current_thread().name, len(batch)))
            return super()._score(batch, reward_fn)

    trainer = Spying(config)
    fit_once(trainer)
    assert scored_on == [("MainThread", 8 * 2)] * 3  # one call a step: its 8 groups x 2 samples
    rm = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    for batch in trainer.learned:
        scores = batch.batch["token_level_scores"].sum(-1)
        for row in range(len(scores)):
            mask = batch.batch["attention_mask"][row].bool()
            expected = score_at_last_token(rm, batch.batch["input_ids"][row][mask].unsqueeze(0))
            assert abs(scores[row].item() - expected) < 1e-4, (row, scores[row].item(), expected)
    metrics = read_metrics(run_dir)
    assert [(m["async_training/staleness/min"], m["async_training/staleness/max"]) for m in metrics] == [
        (0, 0), (1, 1), (1, 1)]
    for m, batch in zip(metrics, trainer.learned, strict=True):
        assert m["timing_s/reward"] > 0 and m["data_flow/num_groups_trained"] == 8
        trained_mean = batch.batch["token_level_scores"].sum(-1).mean().item()
        assert abs(m["data_flow/generated_reward/mean"] - trained_mean) < 1e-5


def group_prompt(group) -> int:
    return group[0]["metadata"]["extra_info"]["index"]


def saved_prompt_source(run_dir, step: int) -> dict:
    saved = torch.load(os.path.join(run_dir, step_dir_name(step), DATA_STATE_FILE), weights_only=True)
    assert "in_flight" not in saved  # the data flow keeps what is in flight in the prompt source's buffer
    return saved["prompt_source"]


def prompts_held(source_state: dict) -> list[int]:
    """Every prompt a prompt source's state holds: its buffer's groups and the data rows not yet made groups."""
    return [group_prompt(group) for group in source_state["buffer"]] + [
        row["extra_info"]["index"] for row in source_state["pending_rows"]]


def counted_drops(metrics: list[dict]) -> int:
    return int(sum(m["data_flow/num_dropped_groups"] + m["async_training/dropped_groups"] for m in metrics))


@pytest.mark.slow
def test_fully_async_runs_the_data_flow_within_the_staleness_bound_and_resumes_what_was_in_flight(ray_local, toy_task,
                                                                                                  tmp_path):
    """fully_async on the data flow (dynamic sampling, partial rollout, max_staleness 1, separate pools), stopped
    after step 2 and resumed. Whatever the threads' timing: no trained sample is staler than the bound; the
    data_flow/* counts are logged every step; every prompt taken from the data is trained, held in the prompt
    source (the checkpoint's buffer and rows) or counted dropped; the resumed run trains first the kept groups the
    checkpoint saved that are still fresh enough."""
    overrides = [*SPLIT, "async_training.mode=fully_async", "async_training.max_staleness=1",
                 "async_training.stale_samples=requeue", "data_flow.enable=true", "data_flow.partial_rollout=true",
                 "data_flow.dynamic_sampling_filter.name=check_reward_nonzero_std", "trainer.save_freq=10",
                 "trainer.total_training_steps=4", "trainer.test_freq=-1"]
    first, held = train(make_config(toy_task, str(tmp_path), *overrides), stop_after=2)
    assert (type(first.placement), type(first.schedule)) == (SeparatePool, FullyAsync)
    saved = saved_prompt_source(tmp_path, 2)
    saved_prompts = prompts_held(saved)
    assert held == saved_prompts
    assert saved_prompts, "a checkpoint of an asynchronous run with nothing in flight tests nothing"
    first_metrics = read_metrics(str(tmp_path))
    trained_first = [index for step in first.trained_prompts for index in step]
    # nothing lost: every prompt taken is trained, saved, or counted dropped (by the filter or as too stale)
    assert not collections.Counter(trained_first + saved_prompts) - collections.Counter(first.taken_prompts)
    assert len(first.taken_prompts) == len(trained_first) + len(saved_prompts) + counted_drops(first_metrics)
    # the kept groups (scored, finished) come first in the buffer; those fresh enough for step 3 (policy version 2,
    # bound 1: oldest token of version 1 or later) are trained by it first
    kept = [group for group in saved["buffer"] if all(sample["reward"] is not None for sample in group)]
    assert saved["buffer"][:len(kept)] == kept
    fresh = [group_prompt(group) for group in kept
             if min(v for sample in group for v in sample["token_versions"] if v >= 0) >= 1][:8]

    second, _ = train(make_config(toy_task, str(tmp_path), *overrides))
    assert second.global_steps == 4 and len(second.trained_prompts) == 2
    assert not collections.Counter(fresh) - collections.Counter(second.trained_prompts[0])
    metrics = {int(m["training/global_step"]): m for m in read_metrics(str(tmp_path))}
    metrics = [metrics[step] for step in (1, 2, 3, 4)]
    trained_second = [index for step in second.trained_prompts for index in step]
    final = prompts_held(second.prompt_source.state_dict())  # the end's in-flight groups went back to it
    assert not collections.Counter(trained_second + final) - collections.Counter(saved_prompts + second.taken_prompts)
    assert len(saved_prompts) + len(second.taken_prompts) == len(trained_second) + len(final) + counted_drops(
        metrics[2:])
    assert len(trained_first) + len(trained_second) == 4 * 8
    assert [m["async_training/policy_version"] for m in metrics] == [0, 1, 2, 3]
    for m in metrics:
        assert 0 <= m["async_training/staleness/min"] <= m["async_training/staleness/max"] <= 1, m
        assert m["data_flow/staleness/max"] <= 1
        assert m["data_flow/num_groups_trained"] == 8 and m["data_flow/buffer_size"] >= 0
        for count in ("num_dropped_groups", "num_aborted_groups", "num_aborted_samples", "num_submitted_groups"):
            assert m[f"data_flow/{count}"] >= 0, count
        assert m["async_training/requeued_groups"] >= 0 and m["async_training/dropped_groups"] == 0
        assert 0 <= m["async_training/groups_ahead"] <= 16  # (max_staleness + 1) x 8 at most


# Learning: the toy task's GRPO run (test_e2e_training.test_grpo_learns_the_toy_task's settings, 20 steps) with the
# synchronous colocated loop, one-step-off and fully asynchronous (max_staleness 1). Each must raise its score by
# more than RISE (the sync test's bar), and its last-4-step mean score must lie within MODE_MARGIN of the sync run's.
# Measured over seeds 1-8 (`--learning-seeds 1-8`, conftest) on the 2-core machine, 2026-11-28, as the rise of the
# mean score from steps 1-4 to steps 17-20: sync 0.494-0.599, one_step_off 0.409-0.534, fully_async 0.405-0.510. The
# asynchronous modes ended 0.02-0.11 below sync (one_step_off mean 0.062, sd 0.031; fully_async 0.066, sd 0.024):
# their samples are one version old, so each update starts from a slightly older policy. RISE is under half the
# smallest rise seen; MODE_MARGIN = 0.15 is about 3 sds above the mean gap of either mode. A run that stopped learning
# (stale weights never replaced, lost samples) stays near 0.08 and fails RISE first.
LEARN = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "data.train_batch_size=8",
         "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
         "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=20", "trainer.test_freq=-1"]
LEARN_MODES = {"sync": ["trainer.n_gpus_per_node=1"],
               "one_step_off": [*SPLIT, "async_training.mode=one_step_off"],
               "fully_async": [*SPLIT, "async_training.mode=fully_async", "async_training.max_staleness=1"]}
RISE = 0.2
MODE_MARGIN = 0.15


def learning_curve(toy_task, run_dir, mode, seed_overrides):
    train(make_config(toy_task, str(run_dir), *LEARN, *LEARN_MODES[mode], *seed_overrides))
    return [m["critic/score/mean"] for m in read_metrics(str(run_dir))]


@pytest.mark.slow
def test_async_schedules_learn_the_toy_task_like_the_synchronous_loop(ray_local, toy_task, tmp_path, seed_overrides,
                                                                       learning_log):
    curves = {mode: learning_curve(toy_task, tmp_path / mode, mode, seed_overrides) for mode in LEARN_MODES}
    first = {mode: sum(scores[:4]) / 4 for mode, scores in curves.items()}
    last = {mode: sum(scores[-4:]) / 4 for mode, scores in curves.items()}
    learning_log(**{f"{mode}_{end}": round(ends[mode], 4) for mode in LEARN_MODES
                    for end, ends in (("first", first), ("last", last))})
    for mode, scores in curves.items():
        assert last[mode] > first[mode] + RISE, (mode, scores)
    for mode in ("one_step_off", "fully_async"):
        assert abs(last[mode] - last["sync"]) < MODE_MARGIN, last
