"""No silent non-learning (issue #12, point 2): skipped optimizer steps are counted and bounded,
non-finite log-probs stop the run at once, and the error reaches the user with the step, the phase
and the likely causes.

Unit tests drive NonFiniteStepGuard with the metric lists the workers return; two end-to-end runs
(real Ray, 2 gloo ranks, the toy task of test_e2e_training) provoke each case for real: a reward
function that returns NaN (every update skipped: the run must stop at step 3 with exit code != 0),
and a model whose weights hold NaN (its log-probs are NaN: the run must stop at step 1).
"""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo.nonfinite_guard import NonFiniteStepGuard, NonFiniteTrainingError, check_finite_at_responses
from hybridrl.trainer.ppo.ray_trainer import RayPPOTrainer
from tests.test_e2e_training import make_config

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAN = float("nan")


def update_batch(advantages: torch.Tensor | None = None) -> DataProto:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    return DataProto.from_dict({"response_mask": mask, "advantages": torch.zeros(2, 3) if advantages is None
                                else advantages, "old_log_probs": torch.zeros(2, 3)})


def actor_metrics(*norms: float, world_size: int = 2) -> dict[str, list[float]]:
    """What update_actor returns: every rank's copy of the per-mini-batch-step values, rank after rank."""
    per_rank = {"actor/grad_norm": list(norms), "actor/pg_loss": [NAN if math.isnan(n) else 0.5 for n in norms]}
    return {key: values * world_size for key, values in per_rank.items()}


def test_skipped_steps_are_counted_and_the_third_in_a_row_stops_the_run():
    guard = NonFiniteStepGuard(max_consecutive=3, world_size=2)
    batch = update_batch(torch.tensor([[NAN, 1.0, NAN], [0.5, 0.0, 0.0]]))  # one NaN advantage at a response token
    assert guard.after_update("update_actor", actor_metrics(NAN, 0.3), batch, step=1) == {"actor/skipped_steps": 1.0}
    # a finite step ends the streak: two more skipped steps are not yet three in a row
    assert guard.after_update("update_actor", actor_metrics(NAN, NAN), batch, step=2) == {"actor/skipped_steps": 2.0}
    # the critic keeps its own count
    critic = {"critic/grad_norm": [NAN, NAN], "critic/vf_loss": [1.0, 1.0]}
    assert guard.after_update("update_critic", critic, batch, step=2) == {"critic/skipped_steps": 1.0}
    with pytest.raises(NonFiniteTrainingError) as error:
        guard.after_update("update_actor", actor_metrics(NAN, 0.2), batch, step=3)  # the 3rd in a row
    message = str(error.value)
    assert message.startswith("update_actor: 3 consecutive optimizer steps had a non-finite gradient norm and were "
                              "skipped (no weights changed), the last at training step 3 (mini-batch step 1 of 2)")
    assert "trainer.max_consecutive_nonfinite_steps=3" in message
    assert "actor/grad_norm=nan, actor/pg_loss=nan" in message
    assert "advantages at 1 response positions (rows 0)" in message  # the NaN under padding is not counted
    assert "Likely causes: a reward function or reward model that returns NaN/inf" in message


def test_a_non_finite_step_with_a_finite_batch_points_at_the_update_itself():
    guard = NonFiniteStepGuard(max_consecutive=1, world_size=1)
    with pytest.raises(NonFiniteTrainingError, match="at training step 7 .*The batch's rewards, advantages and "
                                                     "log-probs are all finite.* Likely causes: a bf16/fp16"):
        guard.after_update("update_actor", actor_metrics(float("inf"), world_size=1), update_batch(), step=7)


def test_non_finite_log_probs_stop_at_once_and_padding_is_ignored():
    batch = update_batch()
    batch.batch["ref_log_prob"] = torch.tensor([[-1.0, -2.0, NAN], [-1.0, NAN, NAN]])  # NaN only under padding
    check_finite_at_responses(batch, "ref_log_prob", "ref", step=4)
    batch.batch["ref_log_prob"][1, 0] = -float("inf")
    with pytest.raises(NonFiniteTrainingError, match=r"^ref: ref_log_prob is not finite at 1 of 3 response positions "
                                                     r"\(rows 1\) at training step 4; the run stops at once"):
        check_finite_at_responses(batch, "ref_log_prob", "ref", step=4)


# ---------------------------------------------------------------------- end to end

# NaN rewards no longer get this far (the reward manager counts them as errors): an estimator that returns NaN
# advantages is the user-side source of non-finite steps left.
NAN_ESTIMATOR = '''
import torch
from hybridrl.algorithms.core_algos import register_adv_est

@register_adv_est("nan_advantages")
def nan_advantages(token_level_rewards, response_mask, **kwargs):
    nan = torch.full_like(token_level_rewards, float("nan")) * response_mask
    return nan, nan
'''
ZERO_REWARD = '''
def zero_score(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
'''


@pytest.mark.slow
def test_nan_advantages_stop_the_run_at_step_3_with_a_message_naming_the_cause(ray_local, toy_task, tmp_path):
    """`python -m hybridrl.main_ppo` as a user runs it: every advantage is NaN, so every update is
    skipped; steps 1 and 2 are logged with actor/skipped_steps=1, step 3 ends the run with exit code 1."""
    extension = tmp_path / "nan_estimator.py"
    extension.write_text(NAN_ESTIMATOR)
    reward_file = tmp_path / "zero_reward.py"
    reward_file.write_text(ZERO_REWARD)
    run_dir = tmp_path / "run"
    overrides = [
        f"actor_rollout_ref.model.path={toy_task['model']}", f"data.train_files={toy_task['train']}",
        f"data.val_files={toy_task['val']}", f"extensions=[{extension}]",
        "algorithm.adv_estimator=nan_advantages", f"custom_reward_function.path={reward_file}",
        "custom_reward_function.name=zero_score", "data.max_prompt_length=32", "data.max_response_length=8",
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=2",
        "trainer.n_gpus_per_node=2", "trainer.total_training_steps=6", "trainer.val_before_train=false",
        "trainer.logger=[console,jsonl]", f"trainer.default_local_dir={run_dir}", "trainer.device=cpu",
        f"ray_init.address={ray_local.get_runtime_context().gcs_address}",  # the session's Ray: no second start
    ]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    result = subprocess.run([sys.executable, "-m", "hybridrl.main_ppo", *overrides], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    last_line = result.stderr.strip().splitlines()[-1]  # the reason, not a traceback, is what the user sees last
    assert last_line.startswith("training stopped: update_actor: 3 consecutive optimizer steps had a non-finite "
                                "gradient norm and were skipped (no weights changed), the last at training step 3 "
                                "(mini-batch step 1 of 1)")
    assert re.search(r"advantages at \d+ response positions \(rows 0, 1, 2, 3, 4, 5, 6, 7 and 8 more\)", last_line)
    assert "token_level_scores" not in last_line.split("Likely causes")[0]  # the rewards were finite
    assert "Likely causes: a reward function or reward model that returns NaN/inf" in last_line
    with open(run_dir / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [m["step"] for m in logged] == [1, 2]
    assert [m["actor/skipped_steps"] for m in logged] == [1, 1]


@pytest.mark.slow
def test_nan_weights_stop_the_run_at_the_first_log_prob_pass(ray_local, toy_task, tmp_path):
    nan_model = str(tmp_path / "nan_model")
    model = AutoModelForCausalLM.from_pretrained(toy_task["model"])
    with torch.no_grad():
        model.model.norm.weight.fill_(NAN)  # every hidden state, so every logit, is NaN
    model.save_pretrained(nan_model)
    AutoTokenizer.from_pretrained(toy_task["model"]).save_pretrained(nan_model)
    config = make_config(toy_task, str(tmp_path / "run"), f"actor_rollout_ref.model.path={nan_model}",
                         "actor_rollout_ref.rollout.do_sample=false")  # sampling from NaN would fail earlier
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    try:
        with pytest.raises(NonFiniteTrainingError, match=r"^compute_log_prob: old_log_probs is not finite at (\d+) of "
                                                         r"\1 response positions .* at training step 1;"):
            trainer.fit()
    finally:
        trainer.shutdown()
