"""One generation route (issue 58): every step of every schedule, with the colocated engines' batched call or agent
loops on engine servers, gets its batch from the sample-group flow; verl's DAPO keys train in rollout.mode=sync with
the hf engine on the CPU.

Real local Ray, gloo ranks, the toy task of test_e2e_training (a tiny Qwen2), 2 steps a run.
"""
import json

import numpy as np
import pytest

from hybridrl.agent_loop.manager import AgentLoopManager
from hybridrl.trainer.ppo import generate
from hybridrl.trainer.ppo.group_rollout import GroupRollout
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from tests.test_async_training import SPLIT
from tests.test_e2e_training import fit_once, make_config

# acc: constant for even prompts (their groups always have zero variance: DAPO drops them), else the parity of the
# response's length in characters (a group of 4 is all-equal about 1 time in 8)
DAPO_REWARD = '''
def score_and_acc(data_source, solution_str, ground_truth, extra_info=None):
    acc = 1.0 if extra_info["index"] % 2 == 0 else float(len(solution_str) % 2)
    return {"score": solution_str.count("a") / max(len(solution_str), 1), "acc": acc}
'''
GROUPS, N, GEN_BATCH = 8, 4, 12


def recorded(monkeypatch, cls, name):
    """Every call of cls.name, in order: the arguments after self and what it returned."""
    calls = []
    real = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        calls.append((args, result))
        return result

    monkeypatch.setattr(cls, name, wrapper)
    return calls


def hand_count(scored_groups: list[list[list[float]]], wanted: int) -> dict[str, int]:
    """The built-in rollout function's counts, by hand, from each batched call's groups' acc values in finishing
    order: a group is kept while fewer than `wanted` are (when its acc values differ), dropped while fewer are kept
    (when they are all equal), and goes back to the buffer once enough are kept."""
    kept = dropped = returned = 0
    for accs in (group for call in scored_groups for group in call):
        if kept == wanted:
            returned += 1
        elif np.std(accs) > 1e-6:
            kept += 1
        else:
            dropped += 1
    return {"kept": kept, "dropped": dropped, "returned": returned}


def test_dapo_keys_train_in_sync_mode_with_the_hf_engine_filtering_by_a_hand_count(ray_local, toy_task, tmp_path,
                                                                                    monkeypatch):
    reward = tmp_path / "dapo_reward.py"
    reward.write_text(DAPO_REWARD)
    config = make_config(toy_task, str(tmp_path / "run"), "actor_rollout_ref.rollout.mode=sync",
                         "actor_rollout_ref.rollout.name=hf", "algorithm.adv_estimator=grpo",
                         f"actor_rollout_ref.rollout.n={N}", f"data.train_batch_size={GROUPS}",
                         f"data.gen_batch_size={GEN_BATCH}", "algorithm.filter_groups.enable=true",
                         "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=10",
                         f"custom_reward_function.path={reward}", "custom_reward_function.name=score_and_acc",
                         f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")
    engine_calls = recorded(monkeypatch, generate.BatchGenerate, "_generate")
    scored = recorded(monkeypatch, GroupRollout, "score_groups")
    learned = recorded(monkeypatch, RayPPOTrainer, "learn_step")
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        steps = []
        for step in (1, 2):
            trainer.global_steps = step
            calls_before, scored_before = len(engine_calls), len(scored)
            metrics = trainer.train_step()
            accs = [[[sample.metadata["reward_extra_info"]["acc"] for sample in group] for group in groups]
                    for (groups, *_), _ in scored[scored_before:]]
            steps.append((metrics, len(engine_calls) - calls_before, accs, len(trainer.prompt_source.buffer)))
    finally:
        trainer.shutdown()

    for step, (metrics, calls, accs, buffered) in enumerate(steps, start=1):
        count = hand_count(accs, GROUPS)
        with open(tmp_path / "rollouts" / f"{step}.jsonl") as f:  # the dump: trained rows, then the dropped groups'
            dumped = [json.loads(line) for line in f]
        filtered = [record for record in dumped if record.get("filtered")]
        assert len(dumped) - len(filtered) == GROUPS * N and len(filtered) == count["dropped"] * N
        assert all(len([r for r in filtered if r["group"] == record["group"]]) == N for record in filtered)
        assert count["dropped"] >= 1
        assert metrics["data_flow/num_gen_batches"] == calls  # one batched engine call per generated batch
        assert metrics["data_flow/num_dropped_groups"] == count["dropped"]
        assert metrics["data_flow/num_groups_trained"] == count["kept"] == GROUPS
        assert metrics["data_flow/buffer_size"] == buffered == count["returned"]
        assert metrics["data_flow/num_aborted_groups"] == 0  # nothing is in flight between batched calls
    # each call generated every sample of its batch of groups at once (the buffer's groups first, then fresh ones)
    assert all(len(samples) == GEN_BATCH * N for (samples, *_), _ in engine_calls[:1])
    for (batch, *_), _ in learned:  # what trained: GROUPS groups of N rows, each group's acc values not all equal
        assert len(batch) == GROUPS * N
        by_group: dict[str, list[float]] = {}
        for uid, acc in zip(batch.non_tensor_batch["uid"], batch.non_tensor_batch["acc"]):
            by_group.setdefault(uid, []).append(acc)
        assert len(by_group) == GROUPS and all(np.std(values) > 1e-6 for values in by_group.values())


ROUTES = {
    "sync-hf-batched": ["actor_rollout_ref.rollout.mode=sync"],
    "sync-hf-agent_loops": ["actor_rollout_ref.rollout.mode=async", "data.return_raw_chat=true",
                            "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.rollout.agent.num_workers=2"],
    "one_step_off-hf": [*SPLIT, "async_training.mode=one_step_off"],
    "fully_async-hf": [*SPLIT, "async_training.mode=fully_async"],
}
SLOW_ROUTES = {"one_step_off-hf", "fully_async-hf"}  # the asynchronous schedules' runs are the slow tier's


@pytest.mark.parametrize("route", [pytest.param(route, marks=[pytest.mark.slow] if route in SLOW_ROUTES else [])
                                   for route in sorted(ROUTES)])
def test_every_schedule_and_generate_function_trains_each_step_on_the_flows_batch(ray_local, toy_task, tmp_path,
                                                                                 monkeypatch, route):
    """Each schedule x engine pair the CPU runs: every batch learn_step trains is one that GroupRollout.to_batch
    assembled from the flow's scored groups (the same object), once per step, and the groups came through the
    generate function the route names; the old routes are gone."""
    assembled = recorded(monkeypatch, GroupRollout, "to_batch")
    learned = recorded(monkeypatch, RayPPOTrainer, "learn_step")
    submitted = {cls: recorded(monkeypatch, cls, "submit") for cls in (generate.BatchGenerate,
                                                                        generate.AgentLoopGenerate)}
    config = make_config(toy_task, str(tmp_path), *ROUTES[route])
    fit_once(RayPPOTrainer(config))

    assert len(learned) == len(assembled) == 2
    for ((learned_batch, *_), _), (_, (assembled_batch, _)) in zip(learned, assembled):
        assert learned_batch is assembled_batch
        assert len(learned_batch) == 8 * 2 and "token_level_scores" in learned_batch.batch.keys()
    used = generate.BatchGenerate if route == "sync-hf-batched" else generate.AgentLoopGenerate
    unused = generate.AgentLoopGenerate if used is generate.BatchGenerate else generate.BatchGenerate
    assert len(submitted[used]) >= 2 * 8 and submitted[unused] == []
    for gone in ("_generate", "_validate_with_eval_function", "_check_agent_loops"):
        assert not hasattr(RayPPOTrainer, gone)
    assert not hasattr(AgentLoopManager, "generate_sequences")
