"""Checkpoint files: a full disk is named as one (not "unexpected pos 704 vs 598"), and resuming reads the files of a
checkpoint directory without running code planted in them.

The full disk is real: a checkpoint file that is a symlink to /dev/full, whose every write fails with ENOSPC in the
kernel, exactly as on a full file system (no mount rights needed, so it runs in CI).
"""
import errno
import json
import os
import pickle
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from torch.distributed.checkpoint.api import CheckpointException

from hybridrl.trainer.ppo import checkpointing
from hybridrl.trainer.ppo.checkpointing import (LAYOUT_FILE, CheckpointedWorkers, ControllerState,
                                                 TrainDataPosition)
from hybridrl.data.prompt_source import PromptSource
from hybridrl.data.rl_dataset import make_dataloader
from hybridrl.models.checkpoint import load_sharded_model_state, save_sharded_model_state
from hybridrl.trainer.checkpoint_dir import LATEST_POINTER_FILE, step_dir_name
from hybridrl.utils.checkpoint_io import CheckpointSaveError, load_file, save_failures_named

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")

FREE_SPACE = r"\d+(\.\d)? (B|KiB|MiB|GiB|TiB) free on that file system\)"  # the free space itself varies


def _fill_disk_at(path):
    """Make `path` a file whose writes fail with ENOSPC."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink("/dev/full", path)


def _linear_with_optimizer():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


@needs_dev_full
def test_torch_save_on_a_full_disk_said_unexpected_pos():
    """The old failure: torch's own file writer hides the errno."""
    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save({"w": torch.zeros(1000)}, "/dev/full")


@needs_dev_full
@pytest.mark.parametrize("full_file, contents", [
    ("model/__0_0.distcp", ["model"]),  # torch distributed checkpoint's shard of rank 0
    ("extra/rank_0.pt", ["model", "extra"]),  # hybridrl's own file: LR schedule and RNG states
])
def test_a_full_disk_is_named_with_the_directory_and_errno(tmp_path, full_file, contents):
    path = str(tmp_path / ".tmp_global_step_2" / "actor")
    _fill_disk_at(os.path.join(path, full_file))
    model, optimizer, scheduler = _linear_with_optimizer()
    with pytest.raises(CheckpointSaveError) as caught:
        save_sharded_model_state(model, optimizer, scheduler, path, 0, contents)
    message = str(caught.value)
    # torch's distributed checkpoint does not say which of its files failed; hybridrl's own writes do.
    failed_file = "" if full_file.endswith(".distcp") else f": '{os.path.join(path, full_file)}'"
    assert re.fullmatch(re.escape(f"could not write checkpoint files to {path}: [Errno 28] No space left on device"
                                  f"{failed_file} (") + FREE_SPACE, message), message
    assert caught.value.errno == errno.ENOSPC
    crossed = pickle.loads(pickle.dumps(caught.value))  # as it travels from a Ray worker to the controller
    assert (str(crossed), crossed.errno) == (message, errno.ENOSPC)


def test_only_file_system_failures_are_renamed(tmp_path):
    """A bug is not a full disk: it passes unchanged; DCP's CheckpointException (a BaseException) is always named."""
    with pytest.raises(ValueError, match="a bug"):
        with save_failures_named(str(tmp_path), "saving"):
            raise ValueError("a bug")
    failure = CheckpointException("CheckpointException ranks:dict_keys([1])", {1: (KeyError("w"), None)})
    with pytest.raises(CheckpointSaveError) as caught:
        with save_failures_named(str(tmp_path), "saving"):
            raise failure
    assert (str(caught.value), caught.value.errno) == ("saving: KeyError: 'w'", None)


@ray.remote(num_cpus=0)
def _save_linear(path):
    save_sharded_model_state(torch.nn.Linear(3, 2), None, None, path, 0, ["model"])


class _OneRankGroup:
    """The actor worker group's save_checkpoint, one rank, run in a Ray task as the real group's is."""

    def __init__(self, full_disk_at_step=None):
        self.full_disk_at_step = full_disk_at_step

    def save_checkpoint(self, path):
        if os.path.basename(os.path.dirname(path)) == f".tmp_{step_dir_name(self.full_disk_at_step)}":
            _fill_disk_at(os.path.join(path, "model", "__0_0.distcp"))
        ray.get(_save_linear.remote(path))


def _config(root, critic_warmup=0):
    """The keys checkpointing reads: where checkpoints go, how many are kept, the batch layout, critic warmup."""
    return SimpleNamespace(
        trainer=SimpleNamespace(default_local_dir=str(root), max_actor_ckpt_to_keep=None,
                                max_critic_ckpt_to_keep=None, resume_mode="auto", critic_warmup=critic_warmup),
        data=SimpleNamespace(train_batch_size=4),
        actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(n=2), actor=SimpleNamespace(ppo_mini_batch_size=2)))


@needs_dev_full
def test_a_full_disk_in_a_worker_reaches_the_trainer_named_and_loses_nothing(ray_local, tmp_path):
    root = tmp_path / "run"
    workers = checkpointing.CheckpointedWorkers(_OneRankGroup(full_disk_at_step=3))
    state = checkpointing.ControllerState(global_step=2, data_position={"epoch": 0})
    assert checkpointing.save_checkpoint(_config(root), workers, state) == str(root / "global_step_2")
    with pytest.raises(CheckpointSaveError) as caught:
        checkpointing.save_checkpoint(_config(root), workers, checkpointing.ControllerState(3, {"epoch": 0}))
    worker_dir = root / ".tmp_global_step_3" / "actor"
    expected = (f"checkpoint global_step_3 was not saved in {root} (the newest complete checkpoint there is still the "
                f"one a rerun resumes from): could not write checkpoint files to {worker_dir}: [Errno 28] No space "
                f"left on device (")
    assert re.fullmatch(re.escape(expected) + FREE_SPACE, str(caught.value)), str(caught.value)
    assert caught.value.errno == errno.ENOSPC
    assert (root / LATEST_POINTER_FILE).read_text() == "2"
    assert json.loads((root / "global_step_2" / LAYOUT_FILE).read_text()) == {
        "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2}
    assert checkpointing.checkpoint_to_resume(SimpleNamespace(resume_mode="auto", default_local_dir=str(root))) == \
        str(root / "global_step_2")


# ---- save and load with plain state, no trainer ----

class _InProcessGroup:
    """A worker group of one rank in this process: a real model, optimizer and LR schedule, written and read by the
    workers' own writers (models/checkpoint.py); it records the weights version each load is given."""

    def __init__(self):
        self.model, self.optimizer, self.scheduler = _linear_with_optimizer()
        self.loaded_versions = []

    def save_checkpoint(self, path):
        save_sharded_model_state(self.model, self.optimizer, self.scheduler, path, 0, ["model", "optimizer"])

    def load_checkpoint(self, path, weights_version=None):
        load_sharded_model_state(self.model, self.optimizer, self.scheduler, path, 0, ["model", "optimizer"])
        self.loaded_versions.append(weights_version)


def _numbers_position() -> TrainDataPosition:
    """10 numbers in shuffled batches of 3 (3 batches an epoch), each with a prompt of one token for the source."""
    rows = [{"input_ids": torch.tensor([i]), "attention_mask": torch.tensor([1]), "extra_info": {"index": i}}
            for i in range(10)]
    return TrainDataPosition(make_dataloader(rows, batch_size=3, shuffle=True, seed=7, drop_last=True))


def test_save_then_load_gives_back_each_field_of_the_plain_state(tmp_path):
    """save_checkpoint / load_checkpoint with the state itself, no trainer: the actor's and the critic's weights
    come back into fresh models, the actor as the version its steps made (step 5 after 2 warm-up steps: 3), and
    every field of ControllerState as saved: the step, the data position (a fresh one resumes at the 5th batch),
    the KL coefficient and the prompt source (a partial group in its buffer, a row pending), which hands out the
    same groups next."""
    position = _numbers_position()
    source = PromptSource(position.batches, n=2, config=None)
    taken = source.get_groups(5, step=1)  # the first batch's 3 rows and 2 of the second's: 1 row pending
    for sample in taken[4]:
        sample.append([7, 8], None, version=2)
    source.add_groups([taken[4]])
    saved = ControllerState(global_step=5, data_position=position.state_dict(), kl_coef_in_reward=0.0437,
                            prompt_source=source.state_dict())
    actor, critic = _InProcessGroup(), _InProcessGroup()
    root = tmp_path / "run"
    path = checkpointing.save_checkpoint(_config(root, critic_warmup=2), CheckpointedWorkers(actor, critic), saved)
    assert path == str(root / "global_step_5")
    assert sorted(os.listdir(path)) == ["actor", "batch_layout.json", "checkpoint_complete.json", "critic", "data.pt"]

    fresh_actor, fresh_critic = _InProcessGroup(), _InProcessGroup()
    assert not torch.equal(fresh_actor.model.weight, actor.model.weight)
    restored = checkpointing.load_checkpoint(_config(root, critic_warmup=2),
                                             CheckpointedWorkers(fresh_actor, fresh_critic))
    assert torch.equal(fresh_actor.model.weight, actor.model.weight)
    assert torch.equal(fresh_critic.model.weight, critic.model.weight)
    assert fresh_actor.loaded_versions == [3] and fresh_critic.loaded_versions == [None]
    assert restored.global_step == 5
    assert restored.kl_coef_in_reward == 0.0437
    assert restored.data_position.keys() == saved.data_position.keys()
    assert (restored.data_position["epoch"], restored.data_position["batches_done"]) == (0, 2)
    assert torch.equal(restored.data_position["epoch_start_generator_state"],
                       saved.data_position["epoch_start_generator_state"])
    assert restored.prompt_source == saved.prompt_source
    assert restored.prompt_source["buffer"][0][0]["response_ids"] == [7, 8]
    assert [row["extra_info"]["index"] for row in restored.prompt_source["pending_rows"]] == \
        [row["extra_info"]["index"] for row in source.pending_rows]

    resumed_position = _numbers_position()
    resumed_position.load_state_dict(restored.data_position)
    resumed = PromptSource(resumed_position.batches, n=2, config=None)
    resumed.load_state_dict(restored.prompt_source)
    expected = source.get_groups(5, step=2)
    groups = resumed.get_groups(5, step=2)
    assert [group[0].to_dict() for group in groups] == [group[0].to_dict() for group in expected]


def test_a_run_without_the_data_flow_saves_and_gets_back_no_prompt_source(tmp_path):
    """None saves nothing under "prompt_source" in data.pt (as runs without the data flow always wrote it)."""
    group = _InProcessGroup()
    state = ControllerState(global_step=1, data_position={"epoch": 0, "batches_done": 1,
                                                          "epoch_start_generator_state": None})
    path = checkpointing.save_checkpoint(_config(tmp_path), CheckpointedWorkers(group), state)
    assert load_file(os.path.join(path, "data.pt")) == {"global_step": 1, "dataloader": state.data_position,
                                                        "kl_ctrl_in_reward_value": None}
    assert checkpointing.load_checkpoint(_config(tmp_path), CheckpointedWorkers(_InProcessGroup())) == state


# ---- trusted loading ----

def _rng_draws():
    return [random.random(), float(np.random.rand()), torch.rand(2).tolist()]


def test_extra_state_is_plain_values_and_round_trips(tmp_path):
    model, optimizer, scheduler = _linear_with_optimizer()
    path = str(tmp_path / "actor")
    save_sharded_model_state(model, optimizer, scheduler, path, 0, ["model", "optimizer", "extra"])
    expected_draws = _rng_draws()
    extra = torch.load(os.path.join(path, "extra", "rank_0.pt"), weights_only=True)
    assert set(extra) == {"lr_scheduler", "rng"} and extra["lr_scheduler"]["last_epoch"] == 1
    _rng_draws()  # move every RNG on
    restored, restored_optimizer, restored_scheduler = _linear_with_optimizer()
    load_sharded_model_state(restored, restored_optimizer, restored_scheduler, path, 0, ["model", "optimizer", "extra"])
    assert _rng_draws() == expected_draws
    assert restored_scheduler.state_dict() == scheduler.state_dict()
    assert torch.equal(restored.weight, model.weight)


class _PlantedCode:
    """What a stranger's checkpoint file can hold: unpickling it calls os.mkdir(marker)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_resume_does_not_run_code_planted_in_the_extra_state(tmp_path):
    model, optimizer, scheduler = _linear_with_optimizer()
    path = str(tmp_path / "actor")
    save_sharded_model_state(model, optimizer, scheduler, path, 0, ["model", "optimizer", "extra"])
    extra_path = os.path.join(path, "extra", "rank_0.pt")
    marker = str(tmp_path / "code_ran")
    torch.save({"lr_scheduler": scheduler.state_dict(), "rng": _PlantedCode(marker)}, extra_path)

    with pytest.raises(ValueError) as caught:
        load_sharded_model_state(model, optimizer, scheduler, path, 0, ["model", "optimizer", "extra"])
    assert str(caught.value) == (
        f"{extra_path}: expected tensors and plain values only (checkpoint files are read with "
        f"torch.load(weights_only=True)), got a pickle that asks for posix.mkdir; hybridrl does not write such files "
        f"(an older hybridrl saved numpy RNG state); to resume without the LR schedule and RNG states, leave 'extra' "
        f"out of checkpoint.load_contents")
    assert not os.path.exists(marker)
    torch.load(extra_path, weights_only=False)  # what resuming did before: the planted code runs
    assert os.path.isdir(marker)


def test_data_state_is_read_without_unpickling_code(tmp_path):
    marker = str(tmp_path / "code_ran")
    path = str(tmp_path / "data.pt")
    checkpointing.save_data_state(path, {"global_step": 1, "dataloader": _PlantedCode(marker)})
    with pytest.raises(ValueError, match=r"data.pt: expected tensors and plain values only .* asks for posix.mkdir"):
        load_file(path)
    assert not os.path.exists(marker)
