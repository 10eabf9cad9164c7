"""The trainer sends each model pass only the batch tensors it reads (trainer/ppo/worker_inputs.py)."""
import numpy as np
import torch

from hybridrl.protocol import DataProto
from hybridrl.trainer.ppo import worker_inputs

STEP_KEYS = ["prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
             "response_weight_versions", "token_level_scores", "token_level_rewards", "old_log_probs", "entropys",
             "advantages", "returns", "values"]


def step_batch(*extra: str) -> DataProto:
    """A batch as the controller holds it before the update: every column a step makes, dataset columns too."""
    tensors = {key: torch.full((4, 3), float(number)) for number, key in enumerate([*STEP_KEYS, *extra])}
    batch = DataProto.from_dict(tensors=tensors, non_tensors={"uid": ["a", "a", "b", "b"],
                                                              "extra_info": [{"index": i} for i in range(4)]})
    batch.meta_info["temperature"] = 0.7
    return batch


def test_forward_passes_get_their_tensors_and_meta_info_only():
    batch = step_batch()
    sent = worker_inputs.actor_forward(batch)
    assert list(sent.batch.keys()) == ["input_ids", "attention_mask", "position_ids", "responses"]
    assert sent.non_tensor_batch == {} and sent.meta_info == {"temperature": 0.7}
    assert sent.batch["responses"] is batch.batch["responses"]  # shared, not copied
    assert list(worker_inputs.critic_forward(batch).batch.keys()) == [
        "input_ids", "attention_mask", "position_ids", "responses", "response_mask"]


def test_actor_update_adds_what_its_loss_reads():
    plain = worker_inputs.actor_update(step_batch("ref_log_prob"), use_kl_loss=False)
    assert list(plain.batch.keys()) == ["input_ids", "attention_mask", "position_ids", "responses",
                                        "response_mask", "old_log_probs", "advantages"]
    with_kl = worker_inputs.actor_update(step_batch("ref_log_prob", "rollout_is_weights"), use_kl_loss=True)
    assert list(with_kl.batch.keys())[-2:] == ["ref_log_prob", "rollout_is_weights"]
    assert with_kl.non_tensor_batch == {} and len(with_kl) == 4
    np.testing.assert_array_equal(with_kl.batch["advantages"].numpy(), np.full((4, 3), 11.0))


def test_critic_update_gets_values_and_returns():
    sent = worker_inputs.critic_update(step_batch())
    assert list(sent.batch.keys())[-2:] == ["values", "returns"] and len(sent.batch.keys()) == 7
