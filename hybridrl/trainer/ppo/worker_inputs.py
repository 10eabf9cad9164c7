"""What of the training batch each model pass reads: the trainer sends the workers only that.

The batch the controller holds gathers everything its step made: the prompts, the dataset's non-tensor columns
(extra_info, reward_model, raw prompts, ...), scores, rewards, returns, entropies. The log-prob, value and update
passes read a few tensors of it (their `take_keys`, workers/actor/dp_actor.py and workers/critic/dp_critic.py); every
other column would only be pickled on the controller, carried by Ray and unpickled on each rank. On the default's
128 rows that is 457 KB of which the log-prob pass reads 262 KB, the non-tensor columns (dicts in numpy object
arrays) being most of the pickling time. meta_info goes whole (temperature, the balancer's counts).
"""
from __future__ import annotations

from hybridrl.protocol import DataProto
from hybridrl.workers.actor import dp_actor
from hybridrl.workers.critic import dp_critic


def _tensors(batch: DataProto, keys: list[str]) -> DataProto:
    return batch.select(batch_keys=keys, non_tensor_batch_keys=[])


def actor_forward(batch: DataProto) -> DataProto:
    """What compute_log_prob and compute_ref_log_prob read."""
    return _tensors(batch, dp_actor.FORWARD_KEYS)


def actor_update(batch: DataProto, use_kl_loss: bool) -> DataProto:
    """What update_actor reads (ref_log_prob with use_kl_loss; rollout_is_weights when the batch has them)."""
    return _tensors(batch, dp_actor.update_keys(use_kl_loss, batch.batch.keys()))


def critic_forward(batch: DataProto) -> DataProto:
    """What compute_values reads."""
    return _tensors(batch, dp_critic.FORWARD_KEYS)


def critic_update(batch: DataProto) -> DataProto:
    """What update_critic reads."""
    return _tensors(batch, dp_critic.UPDATE_KEYS)
