"""ReMax end to end (issue #12, point 7; issues #26, 58): each group's greedy baseline is generated with the group
(one more sample of it, greedy: data/sample.py), by the engines' batched call in rollout.mode=sync and by the agent
loops on engine servers otherwise, and its score becomes the rows' reward_baselines when the batch is assembled.

Real local Ray, 2 gloo ranks, the toy task of test_e2e_training. A step's batch is checked by hand: reward_baselines
must be the score of each prompt's greedy response under the weights the step started from (lr 0 keeps them, so it
is recomputed after the step through the same engines), and every advantage must be that row's score minus its
prompt's baseline. That check scores by the response's length in characters instead of the share of "a": the
untrained model's greedy answers hold no "a", and a baseline of 0 everywhere would let "advantage = score" pass.
"""
import collections

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.algorithms import core_algos
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from tests.test_e2e_training import fit_once, make_config, read_metrics

N = 4
LENGTH_REWARD = """
def length_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 50
"""


@pytest.fixture
def advantage_batches(monkeypatch) -> list[DataProto]:
    """Every batch a step hands to compute_advantage, as it returns it (advantages added)."""
    seen = []
    real_compute_advantage = core_algos.compute_advantage

    def recording_compute_advantage(data, **kwargs):
        seen.append(real_compute_advantage(data, **kwargs))
        return seen[-1]

    monkeypatch.setattr(core_algos, "compute_advantage", recording_compute_advantage)
    return seen


def greedy_scores_by_prompt(trainer: RayPPOTrainer) -> dict[int, float]:
    """By hand, through the run's engines: every training prompt's greedy response, one prompt per group of one,
    generated apart from any training group by the run's generate function (batched call or agent loops, whichever
    the schedule uses) and scored with the run's reward function, by the prompt's extra_info index."""
    from hybridrl.data.sample import samples_to_batch
    from hybridrl.data.prompt_source import PromptSource
    from hybridrl.trainer.ppo.generate import GREEDY

    trainer.placement.rollout_mode()
    groups = PromptSource(lambda: iter(trainer.train_dataloader), 1, trainer.config).get_groups(1 << 30, step=0)
    generator = trainer.group_rollout.generator
    handles = [generator.submit(group, GREEDY, None, 0, position) for position, group in enumerate(groups)]
    done: dict = {}
    while len(done) < len(handles):
        done.update(generator.wait([handle for handle in handles if handle not in done]))
    trainer.placement.trainer_mode()
    samples = [done[handle][0] for handle in handles]
    rollout = trainer.config.actor_rollout_ref.rollout
    greedy = samples_to_batch(samples, prompt_length=rollout.prompt_length, response_length=rollout.response_length,
                              pad_token_id=trainer.tokenizer.pad_token_id, with_log_probs=False, scored=False)
    values = trainer.reward_fn(greedy, return_dict=True)["reward_tensor"].sum(-1).tolist()
    return {info["index"]: value for info, value in zip(greedy.non_tensor_batch["extra_info"], values)}


def check_baselines(batch: DataProto, expected: dict[int, float], groups: int) -> None:
    """Every trained row's reward_baselines is its prompt's greedy score; the rows are `groups` x N sampled responses
    (no baseline among them, N per uid); each advantage is the row's score minus its baseline."""
    assert len(batch) == groups * N
    assert sorted(collections.Counter(batch.non_tensor_batch["uid"]).values()) == [N] * groups
    want = torch.tensor([expected[info["index"]] for info in batch.non_tensor_batch["extra_info"]])
    torch.testing.assert_close(batch.batch["reward_baselines"], want, rtol=0, atol=1e-6)
    assert float(want.min()) > 0  # each greedy answer was scored (a missing one would be 0)
    scores = batch.batch["token_level_scores"].sum(-1)
    mask = batch.batch["response_mask"].bool()
    expected_advantages = (scores - batch.batch["reward_baselines"]).unsqueeze(-1).expand_as(mask)
    torch.testing.assert_close(batch.batch["advantages"][mask], expected_advantages[mask], rtol=0, atol=1e-6)


ROUTES = {"batched": ["actor_rollout_ref.rollout.mode=sync"],
          "agent_loops": ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
                          "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.agent.num_workers=2"]}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_remax_baselines_each_group_with_its_prompts_greedy_score(ray_local, toy_task, tmp_path, advantage_batches,
                                                                  route):
    """Each group's greedy baseline is generated with the group and its score becomes reward_baselines when the batch
    is assembled; the baseline is no row of the batch."""
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(LENGTH_REWARD)
    config = make_config(toy_task, str(tmp_path), "algorithm.adv_estimator=remax", f"actor_rollout_ref.rollout.n={N}",
                         f"custom_reward_function.path={reward_file}", "custom_reward_function.name=length_score",
                         *ROUTES[route], "data_flow.enable=true", "actor_rollout_ref.actor.optim.lr=0")
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        metrics = trainer.train_step()
        expected = greedy_scores_by_prompt(trainer)
    finally:
        trainer.shutdown()
    [batch] = advantage_batches
    check_baselines(batch, expected, groups=8)
    assert "timing_s/gen_max" not in metrics  # no generation of its own: the baselines came with the groups
    assert metrics["data_flow/num_groups_trained"] == 8
    baselines = {uid: expected[info["index"]] for uid, info in zip(batch.non_tensor_batch["uid"],
                                                                    batch.non_tensor_batch["extra_info"])}
    assert abs(metrics["data_flow/baseline_reward/mean"] - sum(baselines.values()) / 8) < 1e-6
    # the sampled responses' mean, not the greedy ones'
    assert abs(metrics["data_flow/generated_reward/mean"] - metrics["critic/score/mean"]) < 1e-6


SPLIT = ["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
         "actor_rollout_ref.rollout.agent.num_workers=1", "trainer.n_gpus_per_node=1", "rollout.n_gpus_per_node=1"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [["async_training.mode=one_step_off"],
                                      # one request at a time, long enough that a weight sync's recall finds
                                      # some midway (test_data_flow_e2e's partial rollout test does the same)
                                      ["async_training.mode=fully_async", "async_training.max_staleness=1",
                                       "data_flow.partial_rollout=true", "data.max_response_length=32",
                                       "actor_rollout_ref.rollout.max_num_seqs=1"]], ids=["one_step_off", "fully_async"])
def test_remax_under_the_asynchronous_schedules_baselines_each_group_from_its_own_weights(ray_local, toy_task,
                                                                                          tmp_path, schedule):
    """3 ReMax steps on separate pools under each asynchronous schedule (fully_async with partial rollout: an aborted
    baseline is continued with its group): every step's reward_baselines are its prompts' greedy scores (lr 0: the
    weights never change, while their version counts the updates), no baseline is a row; under one_step_off, whose
    engines take new weights only while idle, each baseline's tokens carry its group's one weights version."""
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(LENGTH_REWARD)
    config = make_config(toy_task, str(tmp_path), *SPLIT, *schedule, "algorithm.adv_estimator=remax",
                         f"actor_rollout_ref.rollout.n={N}", f"custom_reward_function.path={reward_file}",
                         "custom_reward_function.name=length_score", "actor_rollout_ref.actor.optim.lr=0",
                         "trainer.total_training_steps=3", "trainer.test_freq=-1")
    batches, versions = [], []

    class Recording(RayPPOTrainer):
        def learn_step(self, batch, timing, metrics):
            batch = super().learn_step(batch, timing, metrics)
            batches.append(batch)
            return batch

    trainer = Recording(config)
    trainer.init_workers()
    to_batch = trainer.group_rollout.to_batch

    def recording_to_batch(groups, weights_version):
        versions.append([([set(s.token_versions) for s in group[:-1]], set(group[-1].token_versions),
                          group[-1].is_baseline) for group in groups])
        return to_batch(groups, weights_version)
    trainer.group_rollout.to_batch = recording_to_batch
    try:
        trainer.fit()
        trainer.schedule.return_in_flight()
        expected = greedy_scores_by_prompt(trainer)
    finally:
        trainer.shutdown()
    metrics = read_metrics(str(tmp_path))
    assert len(batches) == 3 and [m["async_training/policy_version"] for m in metrics] == [0, 1, 2]
    for batch in batches:
        check_baselines(batch, expected, groups=8)
    for step in versions:
        assert all(is_baseline for _, _, is_baseline in step)
    if "async_training.mode=one_step_off" in schedule:
        assert [sorted({v for s, _, _ in step for sample in s for v in sample}) for step in versions] == [[0], [0], [1]]
        for step in versions:
            for sampled_versions, baseline_versions, _ in step:
                assert all(v == baseline_versions for v in sampled_versions)


@pytest.mark.slow
def test_remax_one_step_off_saves_the_groups_generated_ahead_with_their_baselines_and_trains_them_on_resume(
        ray_local, toy_task, tmp_path):
    """one_step_off stopped after step 2: the checkpoint's buffer holds step 3's groups, generated ahead, each with its
    scored greedy baseline last (plain values in data.pt, of the same weights version as its group); the resumed run
    trains those groups first, their saved baseline scores as reward_baselines (not generated again)."""
    import os

    from hybridrl.trainer.checkpoint_dir import step_dir_name
    from hybridrl.trainer.ppo.checkpointing import DATA_STATE_FILE
    from tests.test_async_training import recording

    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(LENGTH_REWARD)
    run_dir = tmp_path / "run"
    overrides = [*SPLIT, "async_training.mode=one_step_off", "algorithm.adv_estimator=remax",
                 f"actor_rollout_ref.rollout.n={N}", f"custom_reward_function.path={reward_file}",
                 "custom_reward_function.name=length_score", "actor_rollout_ref.actor.optim.lr=1e-2",
                 "trainer.save_freq=10", "trainer.total_training_steps=4", "trainer.test_freq=-1"]

    def run(stop_after):
        config = make_config(toy_task, str(run_dir), *overrides)
        trainer = recording(RayPPOTrainer, stop_after)(config)
        fit_once(trainer)
        return trainer

    first = run(stop_after=2)
    saved = torch.load(os.path.join(run_dir, step_dir_name(2), DATA_STATE_FILE), weights_only=True)
    ahead = saved["prompt_source"]["buffer"]
    assert first.global_steps == 2 and len(ahead) == 8
    baselines = {}
    for group in ahead:
        assert len(group) == N + 1 and [s["is_baseline"] for s in group] == [False] * N + [True]
        assert all(s["reward"] is not None and s["status"] in ("completed", "truncated") for s in group)
        assert {v for s in group for v in s["token_versions"]} == {1}  # the weights after step 1, all of them
        baselines[group[0]["metadata"]["extra_info"]["index"]] = group[-1]["reward"]
    second = run(stop_after=None)
    assert second.global_steps == 4 and len(first.learned) == len(second.learned) == 2
    resumed = second.learned[0]
    assert len(resumed) == 8 * N
    assert sorted({info["index"] for info in resumed.non_tensor_batch["extra_info"]}) == sorted(baselines)
    want = torch.tensor([baselines[info["index"]] for info in resumed.non_tensor_batch["extra_info"]])
    torch.testing.assert_close(resumed.batch["reward_baselines"], want, rtol=0, atol=1e-6)


# The rise of the mean score from steps 1-4 to steps 27-30, measured over seeds 1-8 (`--learning-seeds 1-8`, conftest)
# on the 2-core machine, 2026-11-28: 0.728, 0.285, 0.595, 0.241, 0.489, 0.347, 0.291, 0.656 (mean 0.454, sd 0.177),
# from 0.064-0.091. ReMax learns the toy task more unevenly than GRPO (one greedy baseline per prompt, 4 samples). The
# bar was 0.4 when the test was written on seed 1 alone; 4 of the 8 seeds are below it. RISE is half the smallest rise
# seen: a run that does not learn stays within about 0.02 of its start, and a wrong sign makes the score fall.
RISE = 0.12


@pytest.mark.slow
def test_remax_learns_the_toy_task(ray_local, toy_task, tmp_path, seed_overrides, learning_log):
    """30 ReMax steps must raise the share of "a" by RISE; a wrong sign makes it fall."""
    config = make_config(toy_task, str(tmp_path), "algorithm.adv_estimator=remax", f"actor_rollout_ref.rollout.n={N}",
                         "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                         "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.total_training_steps=30", *seed_overrides)
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        summary = trainer.fit()
    finally:
        trainer.shutdown()
    steps = read_metrics(str(tmp_path))
    assert summary["steps"] == 30 and len(steps) == 30
    assert all(m["actor/skipped_steps"] == 0 for m in steps)
    scores = [m["critic/score/mean"] for m in steps]
    first, last = sum(scores[:4]) / 4, sum(scores[-4:]) / 4
    learning_log(first=round(first, 4), last=round(last, 4), rise=round(last - first, 4))
    assert last > first + RISE, f"score did not rise: first steps {scores[:4]}, last steps {scores[-4:]}"
