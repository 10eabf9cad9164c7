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

def write_checkpoint(root, step: int, model_dir: str, config, **data_state) -> str:
    """A checkpoint as a run writes it: the actor's DCP shards and HF config, data.pt (the controller's state of a run
    without in-reward KL or data flow, with `data_state`'s keys added or replaced), batch_layout.json."""
    model = torch.nn.Linear(4, 3)
    with atomic_checkpoint_dir(str(root), step) as tmp_dir:
        actor = os.path.join(tmp_dir, "actor")
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(actor, "model"), no_dist=True)
        save_hf_config_and_tokenizer(actor, AutoConfig.from_pretrained(model_dir),
                                     AutoTokenizer.from_pretrained(model_dir))
        position = {"epoch": 0, "batches_done": step, "epoch_start_generator_state": None}
        torch.save({"global_step": step, "dataloader": position, "kl_ctrl_in_reward_value": None, **data_state},
                   os.path.join(tmp_dir, "data.pt"))
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


def test_a_checkpoint_of_the_earlier_format_is_refused_naming_its_data_file(inputs, tmp_path, run_dir):
    """Until 2026-12-01 an asynchronous run listed its prompts in flight in data.pt under "in_flight"; that reader is
    gone, so such a checkpoint is refused before the run starts, naming the file (not resumed without them)."""
    earlier = {"prompts": [{"tensors": {"input_ids": torch.tensor([[0, 5, 6]])},
                            "columns": {"extra_info": [{"index": 3}]}}]}
    step_dir = write_checkpoint(run_dir, 2, inputs["model"], config_for(inputs, tmp_path), in_flight=earlier)
    assert checked(inputs, tmp_path)[0] == [
        f"trainer.resume_mode: expected data.pt of the current format (the work in flight in its prompt source), got "
        f"'{step_dir}/data.pt' of the earlier format (its in-flight prompts listed under 'in_flight', written until "
        f"2026-12-01), which this hybridrl no longer reads; set trainer.resume_mode=disable to start fresh, or delete "
        f"{step_dir} to resume from the one before"]
    assert checked(inputs, tmp_path, "trainer.resume_mode=disable") == ([], [])


def test_controller_state_this_run_cannot_take_back_is_refused(inputs, tmp_path, run_dir):
    """data.pt against what the run restores: the in-reward KL coefficient, the prompt source of a synchronous run
    with the data flow, and no work in flight for a run without the data flow; a data.pt without its keys."""
    config = config_for(inputs, tmp_path)
    avoid = "set trainer.resume_mode=disable to start fresh, or delete {} to resume from the one before"
    step_dir = write_checkpoint(run_dir, 2, inputs["model"], config)
    data_state = f"'{step_dir}/data.pt'"
    assert checked(inputs, tmp_path, "algorithm.use_kl_in_reward=true")[0] == [
        f"trainer.resume_mode: expected the in-reward KL coefficient algorithm.use_kl_in_reward=true resumes, got "
        f"{data_state} without one (saved by a run without it); {avoid.format(step_dir)}"]
    data_flow = ["data_flow.enable=true", "data.return_raw_chat=true"]
    assert checked(inputs, tmp_path, *data_flow)[0] == [
        f"trainer.resume_mode: expected the prompt source (sample buffer) that data_flow.enable=true resumes, got "
        f"{data_state} without one (saved by a run without the data flow: its batches would not resume exactly); "
        f"{avoid.format(step_dir)}"]

    group = [{"index": 0, "group_index": 0, "prompt_ids": [1, 2], "response_ids": [3], "status": "aborted"}]
    source = {"buffer": [group], "pending_rows": [{"extra_info": {"index": 5}}], "next_group_index": 4,
              "next_sample_index": 8}
    step_dir = write_checkpoint(run_dir, 3, inputs["model"], config, kl_ctrl_in_reward_value=0.05,
                                prompt_source=source)
    assert checked(inputs, tmp_path, "algorithm.use_kl_in_reward=true", *data_flow) == ([], [])
    assert checked(inputs, tmp_path)[0] == [
        f"trainer.resume_mode: expected no work in flight in a checkpoint resumed without the data flow, got "
        f"'{step_dir}/data.pt' holding groups in its prompt source's buffer, which this run would not resume as "
        f"saved; resume it with the data flow (data_flow.enable, algorithm.filter_groups.enable or "
        f"async_training.mode as it was saved); {avoid.format(step_dir)}"]
    # prompt rows read ahead (every synchronous checkpoint holds the next batch's) are taken back by any run
    step_dir = write_checkpoint(run_dir, 4, inputs["model"], config, prompt_source={**source, "buffer": []})
    assert checked(inputs, tmp_path) == ([], [])

    os.remove(os.path.join(step_dir, "data.pt"))
    torch.save({"global_step": 4}, os.path.join(step_dir, "data.pt"))
    assert checked(inputs, tmp_path)[0] == [
        f"trainer.resume_mode: expected '{step_dir}/data.pt' to hold ['global_step', 'dataloader', "
        f"'kl_ctrl_in_reward_value'], got it without ['dataloader', 'kl_ctrl_in_reward_value']; "
        f"{avoid.format(step_dir)}"]


def test_a_run_with_a_critic_refuses_a_checkpoint_without_one(inputs, tmp_path, run_dir):
    """Before: FileNotFoundError from the controller after the workers had started and loaded the actor."""
    step_dir = write_checkpoint(run_dir, 2, inputs["model"], config_for(inputs, tmp_path))
    assert checked(inputs, tmp_path, "critic.enable=true")[0] == [
        f"trainer.resume_mode: expected '{step_dir}/critic', the critic's shards (this run trains a critic), got no "
        f"such directory (pruned by trainer.max_critic_ckpt_to_keep, or saved by a run without a critic); set "
        f"trainer.resume_mode=disable to start fresh, or delete {step_dir} to resume from the one before"]
