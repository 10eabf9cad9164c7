"""The trainer's checkpoints: what the controller saves next to the workers' shards, and how a run resumes.

A checkpoint is ``{trainer.default_local_dir}/global_step_N/`` (layout and atomicity: trainer/checkpoint_dir.py)::

    actor/     the actor worker group's shards + huggingface/ (ActorRolloutRefWorker.save_checkpoint)
    critic/    the critic's shards, when the run has a critic
    batch_layout.json  data.train_batch_size, rollout.n, ppo_mini_batch_size (checked on resume: resume_checks.py)
    data.pt    the controller's state: the training dataloader's position, the in-reward KL coefficient; with
               data_flow (and so in every asynchronous run), the prompt source: its buffer of Sample records with
               their partial tokens, which holds all the work in flight at the save, and its pending rows

Exact resume needs the controller to replay the same batches: a seeded sampler draws one permutation per epoch
from its generator, so ``TrainDataPosition`` remembers the generator's state at the start of the current epoch and
how many of the epoch's batches were trained on. On resume the generator is set back to that state and those
batches are skipped, so the resumed run sees exactly the batches the uninterrupted run would have seen.

``trainer.resume_mode``: ``auto`` resumes from the newest complete checkpoint under ``default_local_dir`` (or starts
fresh when there is none), ``resume_path`` from ``trainer.resume_from_path`` (a ``global_step_N`` directory),
``disable`` always starts fresh. Every file of the checkpoint directory is read back, some of them (torch's
distributed-checkpoint metadata) with pickle: resume only from a directory you trust.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from hybridrl.trainer.checkpoint_dir import (COMPLETE_MARKER_FILE, atomic_checkpoint_dir, checkpoint_step,
                                             find_latest_checkpoint, prune_checkpoints, step_dir_name)
from hybridrl.utils.checkpoint_io import load_file, save_failures_named, save_file

DATA_STATE_FILE = "data.pt"
# The batch layout the checkpoint's data position and optimizer state assume (trainer/resume_checks.py compares it
# with the resuming run's before it starts).
LAYOUT_FILE = "batch_layout.json"


def batch_layout(config) -> dict:
    """The settings a checkpoint's data position and optimizer state assume, by key (batch_layout.json)."""
    return {"data.train_batch_size": config.data.train_batch_size,
            "actor_rollout_ref.rollout.n": config.actor_rollout_ref.rollout.n,
            "actor_rollout_ref.actor.ppo_mini_batch_size": config.actor_rollout_ref.actor.ppo_mini_batch_size}


class TrainDataPosition:
    """Iterates the training dataloader epoch after epoch and knows where it is, so a resume can continue there."""

    def __init__(self, dataloader):
        self.dataloader = dataloader
        self.epoch = 0
        self.batches_done = 0  # batches of the current epoch already handed out
        self.epoch_start_generator_state: torch.Tensor | None = None  # None: the epoch has not started

    def batches(self) -> Iterator[dict]:
        """Yield the remaining batches of the current epoch, then those of the next epochs, without end."""
        while True:
            yield from self._rest_of_epoch()
            self.epoch += 1
            self.batches_done = 0
            self.epoch_start_generator_state = None

    def _rest_of_epoch(self) -> Iterator[dict]:
        generator = _sampler_generator(self.dataloader)
        if generator is not None:
            if self.epoch_start_generator_state is None:
                self.epoch_start_generator_state = generator.get_state()
            else:  # resuming inside this epoch: draw the same permutation again
                generator.set_state(self.epoch_start_generator_state)
        batch_iter = iter(self.dataloader)
        for _ in range(self.batches_done):  # already trained on before the checkpoint: skip
            next(batch_iter)
        for batch in batch_iter:
            self.batches_done += 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done,
                "epoch_start_generator_state": self.epoch_start_generator_state}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]
        self.batches_done = state["batches_done"]
        self.epoch_start_generator_state = state["epoch_start_generator_state"]


def _sampler_generator(dataloader) -> torch.Generator | None:
    """The generator a shuffling sampler draws its permutation from (None for a sampler that does not shuffle)."""
    sampler = dataloader.sampler
    if isinstance(sampler, torch.utils.data.RandomSampler) and sampler.generator is None:
        raise ValueError("the training sampler shuffles with torch's global RNG: give it its own seeded generator "
                         "(data/rl_dataset.py create_rl_sampler does) so its order can be saved and resumed")
    return getattr(sampler, "generator", None)


# ----------------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------------

def should_save(trainer, is_last_step: bool) -> bool:
    """Every ``save_freq`` steps and at the last step, when ``save_freq > 0``."""
    save_freq = trainer.config.trainer.save_freq
    return save_freq > 0 and (is_last_step or trainer.global_steps % save_freq == 0)


def save_checkpoint(trainer) -> str:
    """Save ``global_step_{trainer.global_steps}`` atomically, then prune old ones per role; returns its path.

    Old checkpoints are pruned only after the new one is published, so a kill at any point leaves a loadable one.
    The workers get absolute paths: their working directory need not be the controller's. A failed save raises
    CheckpointSaveError naming the checkpoint and the OS error under the failure (a full disk: errno.ENOSPC).
    """
    root = os.path.abspath(trainer.config.trainer.default_local_dir)
    with save_failures_named(root, f"checkpoint {step_dir_name(trainer.global_steps)} was not saved in {root} (the "
                                   f"newest complete checkpoint there is still the one a rerun resumes from)"):
        with atomic_checkpoint_dir(root, trainer.global_steps) as tmp_dir:
            trainer.actor_rollout_wg.save_checkpoint(os.path.join(tmp_dir, "actor"))
            if trainer.use_critic:
                trainer.critic_wg.save_checkpoint(os.path.join(tmp_dir, "critic"))
            save_data_state(os.path.join(tmp_dir, DATA_STATE_FILE), controller_state(trainer))
            with open(os.path.join(tmp_dir, LAYOUT_FILE), "w") as f:
                json.dump(batch_layout(trainer.config), f)
    prune_checkpoints(root, trainer.config.trainer.max_actor_ckpt_to_keep, subdir="actor")
    if trainer.use_critic:
        prune_checkpoints(root, trainer.config.trainer.max_critic_ckpt_to_keep, subdir="critic")
    return os.path.join(root, step_dir_name(trainer.global_steps))


def has_checkpoint(default_local_dir: str, step: int) -> bool:
    """Whether ``global_step_{step}`` under ``default_local_dir`` is a complete checkpoint."""
    path = os.path.join(os.path.abspath(default_local_dir), step_dir_name(step), COMPLETE_MARKER_FILE)
    return os.path.isfile(path)


def controller_state(trainer) -> dict:
    """What lives on the controller and changes during training (the workers save everything else). What an
    asynchronous schedule holds in flight goes back into the prompt source's buffer first (return_in_flight)."""
    kl_ctrl = trainer.kl_ctrl_in_reward
    state = {"global_step": trainer.global_steps, "dataloader": trainer.train_data_position.state_dict(),
             "kl_ctrl_in_reward_value": None if kl_ctrl is None else kl_ctrl.value}
    trainer.return_in_flight()
    if trainer.prompt_source is not None:
        state["prompt_source"] = trainer.prompt_source.state_dict()
    return state


def save_data_state(path: str, state: dict) -> None:
    """Write data.pt (a module-level function so a test can slow it down to kill a save midway)."""
    save_file(state, path)


# ----------------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------------

def checkpoint_to_resume(trainer_config) -> str | None:
    """The ``global_step_N`` directory ``trainer.resume_mode`` says to resume from, or None to start fresh."""
    mode = trainer_config.resume_mode
    if mode == "disable":
        return None
    if mode == "auto":
        return find_latest_checkpoint(os.path.abspath(trainer_config.default_local_dir))
    if mode == "resume_path":
        path = os.path.abspath(trainer_config.resume_from_path)
        checkpoint_step(path)  # raises unless the name is global_step_<N>
        if not os.path.isfile(os.path.join(path, COMPLETE_MARKER_FILE)):
            raise FileNotFoundError(f"trainer.resume_from_path={path!r} is not a complete checkpoint (no "
                                    f"{COMPLETE_MARKER_FILE}): a save that was interrupted, or not a checkpoint")
        return path
    raise ValueError(f"trainer.resume_mode must be auto, disable or resume_path, got {mode!r}")


def load_checkpoint(trainer) -> int:
    """Restore workers and controller from the checkpoint ``resume_mode`` picks; returns the step to continue after.

    Returns 0 (and changes nothing) when there is nothing to resume from.
    """
    path = checkpoint_to_resume(trainer.config.trainer)
    if path is None:
        print(f"checkpointing: nothing to resume from (trainer.resume_mode={trainer.config.trainer.resume_mode}): "
              "training from scratch")
        return 0
    actor_dir, critic_dir = os.path.join(path, "actor"), os.path.join(path, "critic")
    _require_dir(actor_dir, "the actor's shards")
    state = load_file(os.path.join(path, DATA_STATE_FILE))
    trainer.actor_rollout_wg.load_checkpoint(
        actor_dir, weights_version_after(state["global_step"], trainer.config.trainer.critic_warmup))
    if trainer.use_critic:
        _require_dir(critic_dir, "the critic's shards (this run has a critic)")
        trainer.critic_wg.load_checkpoint(critic_dir)
    trainer.train_data_position.load_state_dict(state["dataloader"])
    if trainer.kl_ctrl_in_reward is not None:
        if state["kl_ctrl_in_reward_value"] is None:
            raise ValueError(f"{path}/{DATA_STATE_FILE} has no in-reward KL coefficient, but this run uses "
                             "algorithm.use_kl_in_reward=true: the checkpoint comes from a run without it")
        trainer.kl_ctrl_in_reward.value = state["kl_ctrl_in_reward_value"]
    trainer.restore_prompt_source(state, f"{path}/{DATA_STATE_FILE}")
    print(f"checkpointing: resumed from {path} (global step {state['global_step']})")
    return state["global_step"]


def restore_prompt_source(source, state: dict, where: str) -> None:
    """The prompt source of data.pt's `state` (`where`: its path) when it has one. A checkpoint holding work in
    flight (an asynchronous run's, listed under "in_flight" in the earlier format, or groups and rows its prompt
    source held) is refused by a run without the data flow: a synchronous step trains every prompt it takes, so
    they would be lost."""
    held = state.get("prompt_source") or {}
    if state.get("in_flight") or (source is None and (held.get("buffer") or held.get("pending_rows"))):
        raise ValueError(f"{where} holds the in-flight prompts of an asynchronous run (async_training.mode "
                         "one_step_off / fully_async) or of the data flow; resume it in that mode, or they would be "
                         "lost")
    if source is None:
        return
    if "prompt_source" not in state:
        raise ValueError(f"{where} has no prompt source (sample buffer), but this run uses data_flow: the checkpoint "
                         "comes from a run without it, and its batches would not resume exactly")
    source.load_state_dict(state["prompt_source"])


def restore_async_prompt_source(source, state: dict, where: str) -> None:
    """An asynchronous schedule's prompt source from data.pt's `state` (`where`: its path). A checkpoint from before
    the data flow was the schedules' one path has no prompt source and lists, under "in_flight", the prompts taken
    from the data and not trained yet ({"prompts": [{"tensors": {...}, "columns": {...}}, ...]}, one entry per batch
    or group): they become the source's first rows, fresh groups generated before the data continues where it
    stopped, so the resumed run trains every prompt the uninterrupted one would have. Without either (a synchronous
    run without the data flow trained all it took) the source starts empty at the data's position."""
    if "prompt_source" in state:
        source.load_state_dict(state["prompt_source"])
    in_flight = state.get("in_flight")
    if not in_flight:
        return
    prompts = in_flight.get("prompts") if isinstance(in_flight, dict) else None
    if not isinstance(prompts, list) or not all(isinstance(plain, dict) and isinstance(plain.get("tensors"), dict)
                                                and isinstance(plain.get("columns"), dict) for plain in prompts):
        raise ValueError(f"{where}: expected its in_flight entry as an earlier hybridrl wrote it, {{'prompts': "
                         f"[{{'tensors': {{...}}, 'columns': {{...}}}}, ...]}}, got {in_flight!r:.200}; resume from "
                         f"another checkpoint or start fresh (trainer.resume_mode=disable)")
    source.add_rows([{**plain["tensors"], **plain["columns"]} for plain in prompts])


def weights_version_after(global_step: int, critic_warmup: int) -> int:
    """The policy version of the actor's weights after `global_step` steps: the steps whose update produced them.
    The actor is updated on every step after the first trainer.critic_warmup (RayPPOTrainer.learn_step)."""
    return max(0, global_step - critic_warmup)


def _require_dir(path: str, holds: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is missing: the checkpoint has no {holds}; was it pruned "
                                "(trainer.max_*_ckpt_to_keep) or written by a different kind of run?")
