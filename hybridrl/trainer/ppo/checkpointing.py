"""The trainer's checkpoints: what the controller saves next to the workers' shards, and how a run resumes.

A checkpoint is ``{trainer.default_local_dir}/global_step_N/`` (layout and atomicity: trainer/checkpoint_dir.py)::

    actor/     the actor worker group's shards + huggingface/ (ActorRolloutRefWorker.save_checkpoint)
    critic/    the critic's shards, when the run has a critic
    batch_layout.json  data.train_batch_size, rollout.n, ppo_mini_batch_size (checked on resume: resume_checks.py)
    data.pt    the controller's state: the training dataloader's position, the in-reward KL coefficient; with
               data_flow (and so in every asynchronous run), the prompt source: its buffer of Sample records with
               their partial tokens, which holds all the work in flight at the save, and its pending rows

What goes in and comes out is explicit, never the trainer: ``save_checkpoint(config, workers, state)`` has the
worker groups (``CheckpointedWorkers``) write their shards and writes the controller's ``ControllerState`` (step,
data position, KL coefficient, prompt source with the work in flight returned to it) as data.pt;
``load_checkpoint(config, workers)`` has the workers load their shards and returns that ``ControllerState`` for the
trainer to take back. Whether a checkpoint suits the run is checked before the workers start (resume_checks.py).

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
from dataclasses import dataclass
from typing import Any

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


@dataclass
class ControllerState:
    """What lives on the controller and changes during training; a checkpoint saves it next to the workers' shards
    (data.pt) and a resume returns it. The schedule puts the work it holds in flight back into the prompt source
    before its state is taken, so the prompt source's state holds it."""
    global_step: int
    data_position: dict  # TrainDataPosition.state_dict()
    kl_coef_in_reward: float | None = None  # None: the run has no in-reward KL controller
    prompt_source: dict | None = None  # PromptSource.state_dict(); None: a checkpoint saved without one


@dataclass
class CheckpointedWorkers:
    """The worker groups that save and load their own shards: the actor's, and the critic's when the run has one."""
    actor: Any
    critic: Any | None = None


# The keys data.pt holds, in every checkpoint; "prompt_source" too in a run with the data flow (read by
# trainer/resume_checks.py before the workers start).
DATA_STATE_KEYS = ("global_step", "dataloader", "kl_ctrl_in_reward_value")


# ----------------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------------

def should_save(save_freq: int, global_step: int, is_last_step: bool) -> bool:
    """Every ``trainer.save_freq`` steps and at the last step, when ``save_freq > 0``."""
    return save_freq > 0 and (is_last_step or global_step % save_freq == 0)


def save_checkpoint(config, workers: CheckpointedWorkers, state: ControllerState) -> str:
    """Save ``global_step_{state.global_step}`` under ``trainer.default_local_dir`` atomically, then prune old ones
    per role; returns its path.

    Old checkpoints are pruned only after the new one is published, so a kill at any point leaves a loadable one.
    The workers get absolute paths: their working directory need not be the controller's. A failed save raises
    CheckpointSaveError naming the checkpoint and the OS error under the failure (a full disk: errno.ENOSPC).
    """
    root = os.path.abspath(config.trainer.default_local_dir)
    step = state.global_step
    with save_failures_named(root, f"checkpoint {step_dir_name(step)} was not saved in {root} (the newest complete "
                                   f"checkpoint there is still the one a rerun resumes from)"):
        with atomic_checkpoint_dir(root, step) as tmp_dir:
            workers.actor.save_checkpoint(os.path.join(tmp_dir, "actor"))
            if workers.critic is not None:
                workers.critic.save_checkpoint(os.path.join(tmp_dir, "critic"))
            save_data_state(os.path.join(tmp_dir, DATA_STATE_FILE), _data_state_file(state))
            with open(os.path.join(tmp_dir, LAYOUT_FILE), "w") as f:
                json.dump(batch_layout(config), f)
    prune_checkpoints(root, config.trainer.max_actor_ckpt_to_keep, subdir="actor")
    if workers.critic is not None:
        prune_checkpoints(root, config.trainer.max_critic_ckpt_to_keep, subdir="critic")
    return os.path.join(root, step_dir_name(step))


def has_checkpoint(default_local_dir: str, step: int) -> bool:
    """Whether ``global_step_{step}`` under ``default_local_dir`` is a complete checkpoint."""
    path = os.path.join(os.path.abspath(default_local_dir), step_dir_name(step), COMPLETE_MARKER_FILE)
    return os.path.isfile(path)


def save_data_state(path: str, state: dict) -> None:
    """Write data.pt (a module-level function so a test can slow it down to kill a save midway)."""
    save_file(state, path)


def _data_state_file(state: ControllerState) -> dict:
    saved = {"global_step": state.global_step, "dataloader": state.data_position,
             "kl_ctrl_in_reward_value": state.kl_coef_in_reward}
    if state.prompt_source is not None:
        saved["prompt_source"] = state.prompt_source
    return saved


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


def load_checkpoint(config, workers: CheckpointedWorkers) -> ControllerState | None:
    """Load the workers' shards from the checkpoint ``trainer.resume_mode`` picks and return the controller's state
    saved with them, for the controller to take back; None (and nothing loaded) when there is nothing to resume from.

    Whether the checkpoint suits this run (its model, complete files, batch layout, the roles and controller state
    this run restores) was checked before the workers started (trainer/resume_checks.py).
    """
    path = checkpoint_to_resume(config.trainer)
    if path is None:
        print(f"checkpointing: nothing to resume from (trainer.resume_mode={config.trainer.resume_mode}): "
              "training from scratch")
        return None
    state = _read_data_state(os.path.join(path, DATA_STATE_FILE))
    workers.actor.load_checkpoint(os.path.join(path, "actor"),
                                  weights_version_after(state.global_step, config.trainer.critic_warmup))
    if workers.critic is not None:
        workers.critic.load_checkpoint(os.path.join(path, "critic"))
    print(f"checkpointing: resumed from {path} (global step {state.global_step})")
    return state


def _read_data_state(path: str) -> ControllerState:
    """The controller's state data.pt holds (read without unpickling code: utils/checkpoint_io.load_file)."""
    saved = load_file(path)
    return ControllerState(global_step=saved["global_step"], data_position=saved["dataloader"],
                           kl_coef_in_reward=saved["kl_ctrl_in_reward_value"], prompt_source=saved.get("prompt_source"))


def weights_version_after(global_step: int, critic_warmup: int) -> int:
    """The policy version of the actor's weights after `global_step` steps: the steps whose update produced them.
    The actor is updated on every step after the first trainer.critic_warmup (RayPPOTrainer.learn_step)."""
    return max(0, global_step - critic_warmup)
