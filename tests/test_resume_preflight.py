"""Issue 64, item 3 and item 5's resume with another train_batch_size: the model folder's tokenizer and the
checkpoint to resume from are checked before Ray starts, each line naming the folder or step directory and the key
that avoids it. No Ray here (ray.init is made to fail); the checkpoints are written by the writers a run uses
(atomic_checkpoint_dir, torch.distributed.checkpoint, save_hf_config_and_tokenizer)."""
import json
import os
import shutil

import pytest
import ray
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoConfig, AutoTokenizer

from hybridrl.config import ConfigError, check_before_start
from hybridrl.models.checkpoint import save_hf_config_and_tokenizer
from hybridrl.trainer.checkpoint_dir import atomic_checkpoint_dir
from hybridrl.trainer.ppo.checkpointing import LAYOUT_FILE
from hybridrl.trainer.ppo.checkpointing import batch_layout
from tests.test_preflight import config_for, inputs  # noqa: F401  (inputs is a fixture)


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the checks before start must not start Ray")

    monkeypatch.setattr(ray, "init", refuse)


def checked(inputs, tmp_path, *overrides):
    config = config_for(inputs, tmp_path, *overrides)
    try:
        return [], check_before_start(config)
    except ConfigError as err:
        return err.problems, []


# ---- the model folder's tokenizer ----

def test_model_folder_without_tokenizer_files_is_named(inputs, tmp_path):
    """Before: transformers built an empty tokenizer and the run died 21 s in with "chat_template is not set"."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(inputs["model"], name), model / name)
    assert checked(inputs, tmp_path, f"actor_rollout_ref.model.path={model}")[0] == [
        f"actor_rollout_ref.model.path: expected the tokenizer's files in '{model}' (one of tokenizer.json, "
        f"tokenizer.model, vocab.json, vocab.txt, spiece.model, with tokenizer_config.json), got none of them (files "
        f"there: ['config.json', 'model.safetensors']); copy the tokenizer next to the model, or set data.tokenizer "
        f"to a folder that has it"]
    # a custom chat template does not make up for a missing vocabulary (before: "prompt of row 0 is empty")
    assert len(checked(inputs, tmp_path, f"actor_rollout_ref.model.path={model}",
                       "actor_rollout_ref.model.custom_chat_template='{{ messages[0].content }}'")[0]) == 1
    assert checked(inputs, tmp_path, f"actor_rollout_ref.model.path={model}",
                   f"data.tokenizer={inputs['model']}") == ([], [])


def test_tokenizer_without_a_chat_template_is_named_unless_one_is_configured(inputs, tmp_path):
    model = shutil.copytree(inputs["model"], tmp_path / "model")
    os.remove(os.path.join(model, "chat_template.jinja"))
    assert checked(inputs, tmp_path, f"actor_rollout_ref.model.path={model}")[0] == [
        f"actor_rollout_ref.model.path: expected a chat template in '{model}' (chat_template.jinja, "
        f"chat_template.json, or \"chat_template\" in tokenizer_config.json: the dataset renders every prompt with "
        f"it), got none; use the instruct model's tokenizer, or set actor_rollout_ref.model.custom_chat_template"]
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert checked(inputs, tmp_path, f"actor_rollout_ref.model.path={model}",
                   f"actor_rollout_ref.model.custom_chat_template='{template}'") == ([], [])


# ---- the checkpoint to resume from ----

def write_checkpoint(root, step: int, model_dir: str, config, truncate=None) -> str:
    """A checkpoint as a run writes it: the actor's DCP shards and HF config, data.pt, batch_layout.json."""
    model = torch.nn.Linear(4, 3)
    with atomic_checkpoint_dir(str(root), step) as tmp_dir:
        actor = os.path.join(tmp_dir, "actor")
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(actor, "model"), no_dist=True)
        save_hf_config_and_tokenizer(actor, AutoConfig.from_pretrained(model_dir),
                                     AutoTokenizer.from_pretrained(model_dir))
        torch.save({"global_step": step}, os.path.join(tmp_dir, "data.pt"))
        with open(os.path.join(tmp_dir, LAYOUT_FILE), "w") as f:
            json.dump(batch_layout(config), f)
    return os.path.join(str(root), f"global_step_{step}")


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def test_auto_resume_from_a_checkpoint_of_another_model_is_refused(inputs, tmp_path, run_dir):
    """Before: a raw `Size mismatch ... lm_head.weight` in the workers."""
    other = shutil.copytree(inputs["model"], tmp_path / "other")
    config_path = os.path.join(other, "config.json")
    with open(config_path) as f:
        other_config = json.load(f)
    with open(config_path, "w") as f:
        json.dump({**other_config, "hidden_size": 64, "intermediate_size": 128}, f)
    step_dir = write_checkpoint(run_dir, 2, other, config_for(inputs, tmp_path))
    problems, _ = checked(inputs, tmp_path)
    assert problems == [
        f"trainer.resume_mode: expected a checkpoint of the model this run loads, got '{step_dir}/actor' of another "
        f"one (hidden_size 64 there, 32 in '{inputs['model']}/config.json'; intermediate_size 128 there, 64 in "
        f"'{inputs['model']}/config.json'); set trainer.resume_mode=disable to start fresh, or delete {step_dir} to "
        f"resume from the one before"]
    assert checked(inputs, tmp_path, "trainer.resume_mode=disable") == ([], [])


def test_truncated_shard_and_data_state_name_the_step_directory(inputs, tmp_path, run_dir):
    """Before: two torch tracebacks ending in a bare EOFError."""
    step_dir = write_checkpoint(run_dir, 4, inputs["model"], config_for(inputs, tmp_path))
    shard = os.path.join(step_dir, "actor", "model", "__0_0.distcp")
    full = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(full - 10)
    data_state = os.path.join(step_dir, "data.pt")
    with open(data_state, "r+b") as f:
        f.truncate(os.path.getsize(data_state) // 2)
    step_2 = os.path.join(run_dir, "global_step_2")
    assert checked(inputs, tmp_path, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step_dir}")[0] == [
        f"trainer.resume_from_path: expected a complete checkpoint, got '{shard}' {full - 10} bytes where its "
        f"metadata needs {full} bytes (cut short); set trainer.resume_mode=disable to start fresh, or point "
        f"trainer.resume_from_path at another step",
        f"trainer.resume_from_path: expected a complete checkpoint, got '{data_state}' cut short (not a complete "
        f"torch file); set trainer.resume_mode=disable to start fresh, or point trainer.resume_from_path at another "
        f"step"]
    assert not os.path.exists(step_2)


def test_resume_with_another_train_batch_size_is_refused_unless_accepted(inputs, tmp_path, run_dir):
    """The data position is counted in batches: 3 batches of 16 rows are not 3 batches of 8."""
    saved_with = config_for(inputs, tmp_path, "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4")
    step_dir = write_checkpoint(run_dir, 3, inputs["model"], saved_with)
    assert checked(inputs, tmp_path)[0] == [
        f"trainer.resume_mode: expected the batch layout '{step_dir}' was saved with, got data.train_batch_size=8 "
        f"(saved with 16), actor_rollout_ref.rollout.n=2 (saved with 4); set them back, accept the change with "
        f"trainer.resume_accept_layout_change=true, or set trainer.resume_mode=disable to start fresh, or delete "
        f"{step_dir} to resume from the one before"]
    assert checked(inputs, tmp_path, "trainer.resume_accept_layout_change=true") == ([], [
        f"trainer.resume_mode: resuming '{step_dir}' with another batch layout (data.train_batch_size=8 (saved with "
        f"16), actor_rollout_ref.rollout.n=2 (saved with 4)), accepted by trainer.resume_accept_layout_change=true: "
        f"the data resumes at batch (not row) position, and the saved optimizer state continues under the new sizes"])
    assert checked(inputs, tmp_path, "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=4") == ([], [])
