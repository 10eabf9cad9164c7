"""A user's module written against verl's import paths (verl. -> hybridrl.compat.verl.), loaded through `extensions`,
registers a reward manager, an advantage estimator and a policy loss that one 2-step CPU run then uses."""
import pytest

from test_e2e_training import assert_weights_changed, make_config, read_metrics, run

VERL_USER_MODULE = '''
import torch

from hybridrl.compat.verl.trainer.ppo.core_algos import get_policy_loss_fn, register_adv_est, register_policy_loss
from hybridrl.compat.verl.workers.reward_manager import register
from hybridrl.compat.verl.workers.reward_manager.abstract import AbstractRewardManager


@register("verl_user_length")
class LengthRewardManager(AbstractRewardManager):
    """0.1 per response token, on the last one; the count as extra info."""

    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", **kwargs):
        self.tokenizer = tokenizer

    def __call__(self, data, return_dict=False):
        prompt_length = data.batch["prompts"].shape[-1]
        lengths = data.batch["attention_mask"][:, prompt_length:].sum(-1)
        scores = torch.zeros(data.batch["responses"].shape, dtype=torch.float32)
        scores[torch.arange(len(lengths)), (lengths - 1).clamp(min=0)] = 0.1 * lengths.float()
        if return_dict:
            return {"reward_tensor": scores, "reward_extra_info": {"n_tokens": lengths.tolist()}}
        return scores


@register_adv_est("verl_user_centred")
def centred(token_level_rewards, response_mask, config=None, **kwargs):
    advantages = (token_level_rewards.sum(-1, keepdim=True) - 0.25) * response_mask
    return advantages, advantages


@register_policy_loss("verl_user_vanilla")
def vanilla_with_marker(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                        rollout_is_weights=None):
    loss, metrics = get_policy_loss_fn("vanilla")(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                                  config, rollout_is_weights)
    metrics["actor/verl_user_marker"] = 7.0
    return loss, metrics
'''


def test_verl_path_registrations_from_extensions_drive_a_run(ray_local, toy_task, tmp_path):
    extension = tmp_path / "verl_user_algos.py"
    extension.write_text(VERL_USER_MODULE)
    run_dir = str(tmp_path / "run")
    # no extra key: the manager runs unwatched by reward_model.score_timeout, and the start says so
    config = make_config(toy_task, run_dir, f"extensions=[{extension}]", "reward_model.reward_manager=verl_user_length",
                         "algorithm.adv_estimator=verl_user_centred",
                         "actor_rollout_ref.actor.policy_loss.loss_mode=verl_user_vanilla")
    _, summary, before, after = run(config)
    steps = read_metrics(run_dir)
    assert summary["steps"] == 2 and len(steps) == 2
    for m in steps:
        # the user's manager scored (0.1 per response token) and reported its extra info
        assert m["critic/score/mean"] == pytest.approx(0.1 * m["response_length/mean"], rel=1e-5)
        assert m["reward/n_tokens/mean"] == pytest.approx(m["response_length/mean"], rel=1e-5)
        # the user's estimator: score - 0.25 on every response token
        assert m["critic/advantages/max"] == pytest.approx(m["critic/score/max"] - 0.25, abs=1e-5)
        # the user's loss ran on the actor
        assert m["actor/verl_user_marker"] == pytest.approx(7.0)
    assert_weights_changed(before, after)
