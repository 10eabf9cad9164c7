"""ReMax end to end (issue #12, point 7): a greedy baseline generated and scored every step.

Real local Ray, 2 gloo ranks, the toy task of test_e2e_training (reward: the share of "a" in the
response). A step's batch is checked by hand: reward_baselines must be the score of each prompt's
greedy response under the weights the step started from, and every advantage must be that row's
score minus its prompt's baseline. That check scores by the response's length in characters
instead: the untrained model's greedy answers hold no "a", and a baseline of 0 everywhere would let
"advantage = score" pass.
"""
import pytest
import torch

from hybridrl.data.batch_layout import group_prompts
from hybridrl.protocol import DataProto
from hybridrl.algorithms import core_algos
from hybridrl.trainer.ppo.ray_trainer import GEN_KEYS, RayPPOTrainer
from tests.test_e2e_training import make_config, read_metrics

N = 4
LENGTH_REWARD = """
def length_score(data_source, solution_str, ground_truth, extra_info=None):
    return len(solution_str) / 50
"""


def greedy_scores(trainer: RayPPOTrainer, prompts_batch: DataProto) -> torch.Tensor:
    """By hand: generate each prompt's greedy response and score it with the run's reward function."""
    batch = DataProto(dict(prompts_batch.batch), dict(prompts_batch.non_tensor_batch), {})
    prompts = batch.pop(batch_keys=GEN_KEYS)
    prompts.meta_info = {**trainer._generation_meta(validate=False), "do_sample": False}
    trainer.actor_rollout_wg.rollout_mode()
    batch.union(trainer.actor_rollout_wg.generate_sequences(prompts))
    trainer.actor_rollout_wg.trainer_mode()
    return trainer.reward_fn(batch, return_dict=True)["reward_tensor"].sum(-1)


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


def test_remax_baseline_is_the_greedy_score_and_advantages_are_score_minus_baseline(ray_local, toy_task, tmp_path,
                                                                                    advantage_batches):
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(LENGTH_REWARD)
    config = make_config(toy_task, str(tmp_path), "algorithm.adv_estimator=remax", f"actor_rollout_ref.rollout.n={N}",
                         f"custom_reward_function.path={reward_file}", "custom_reward_function.name=length_score")
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        prompts_batch = DataProto.from_single_dict(next(iter(trainer.train_dataloader)))
        expected_baselines = greedy_scores(trainer, prompts_batch)  # the weights train_step starts from
        metrics = trainer.train_step(prompts_batch)
    finally:
        trainer.shutdown()

    batch = advantage_batches[0].batch
    mask = batch["response_mask"].bool()
    scores = batch["token_level_scores"].sum(-1)
    assert len(scores) == 8 * N and "timing_s/gen_max" in metrics
    # the n responses of a prompt are consecutive (interleaved repeat) and share its greedy baseline
    torch.testing.assert_close(batch["reward_baselines"], expected_baselines.repeat_interleave(N), rtol=0, atol=1e-6)
    assert float(expected_baselines.min()) > 0  # each greedy answer was scored (a missing one would be 0)
    expected_advantages = (scores - batch["reward_baselines"]).unsqueeze(-1).expand_as(mask)
    assert torch.isfinite(batch["advantages"]).all()
    torch.testing.assert_close(batch["advantages"][mask], expected_advantages[mask], rtol=0, atol=1e-6)
    assert (batch["advantages"][~mask] == 0).all()
    assert float((scores - batch["reward_baselines"]).abs().max()) > 0.01  # the baseline is not the score itself


def test_remax_in_the_data_flow_baselines_each_kept_group_with_its_prompts_greedy_score(ray_local, toy_task, tmp_path,
                                                                                        advantage_batches):
    """The data flow hands the step scored groups, not a prompt batch: the greedy baseline is generated from each
    group's own prompt (batch_layout.group_prompts). lr 0 keeps the weights, so the baselines can be recomputed by
    hand after the step, through the same engines, from the prompts the step trained on."""
    reward_file = tmp_path / "length_reward.py"
    reward_file.write_text(LENGTH_REWARD)
    config = make_config(toy_task, str(tmp_path), "algorithm.adv_estimator=remax", f"actor_rollout_ref.rollout.n={N}",
                         f"custom_reward_function.path={reward_file}", "custom_reward_function.name=length_score",
                         "actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
                         "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.agent.num_workers=2",
                         "data_flow.enable=true", "actor_rollout_ref.actor.optim.lr=0", "trainer.balance_batch=false")
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        metrics = trainer.train_step(None)
        [batch] = advantage_batches
        prompts = group_prompts(batch, N)
        assert len(prompts) == 8 and "timing_s/gen_max" in metrics
        for row, group in enumerate(range(0, 8 * N, N)):  # the group's prompt, as its rows hold it
            assert torch.equal(prompts.batch["input_ids"][row], batch.batch["prompts"][group])
            assert len(set(batch.non_tensor_batch["uid"][group:group + N])) == 1
        trainer._rollout_mode()
        greedy = trainer._generate(prompts, n=1, validate=False, do_sample=False)
        trainer._trainer_mode()
        expected = trainer._score(greedy, trainer.reward_fn)["reward_tensor"].sum(-1)
    finally:
        trainer.shutdown()
    torch.testing.assert_close(batch.batch["reward_baselines"], expected.repeat_interleave(N), rtol=0, atol=1e-6)
    assert float(expected.min()) > 0
    scores = batch.batch["token_level_scores"].sum(-1)
    mask = batch.batch["response_mask"].bool()
    expected_advantages = (scores - batch.batch["reward_baselines"]).unsqueeze(-1).expand_as(mask)
    torch.testing.assert_close(batch.batch["advantages"][mask], expected_advantages[mask], rtol=0, atol=1e-6)


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
