"""The checkpoint a run will resume from, checked before Ray starts (trainer.resume_mode auto or resume_path):
before, a checkpoint of another model failed in the workers with a raw `Size mismatch ... lm_head.weight`, and a
truncated shard with two torch tracebacks ending in a bare EOFError, neither naming the step directory.

  the model     each role's huggingface/config.json (saved with the shards) against the model the run loads:
                the keys that fix the weights' shapes (ARCHITECTURE_KEYS) must agree; refused otherwise;
  the roles     each model this run trains (the actor; the critic when critic.enable) has its directory there;
  the files     every shard file the torch.distributed.checkpoint metadata lists is as long as the metadata says,
                and every torch file (data.pt, extra/rank_R.pt) is a complete zip archive; refused otherwise;
  data.pt       the controller's state (trainer/ppo/checkpointing.py) is of the current format (the earlier one,
                written until 2026-12-01, listed an asynchronous run's prompts in flight under "in_flight" and is not
                read any more) and holds what this run takes back: the in-reward KL coefficient when
                algorithm.use_kl_in_reward=true; the prompt source when a synchronous run has the data flow (an
                asynchronous schedule starts an empty one at the data's position); and no buffered groups (work in
                flight) when the run has no data flow, which would not resume them as saved (pending prompt rows,
                a batch read ahead, every run takes back);
  the layout    batch_layout.json (trainer/ppo/checkpointing.py writes it) against this run's: a different
                data.train_batch_size resumes the data at another row (the position is counted in batches), a
                different rollout.n or ppo_mini_batch_size trains another recipe from the saved optimizer state.
                Refused, unless trainer.resume_accept_layout_change=true, which states the difference as a warning.
Every line names the step directory and how to avoid it: trainer.resume_mode=disable, or delete the step directory.
Of the shards only headers and metadata are read (DCP's .metadata is unpickled by torch, as the load will); data.pt (the
controller's state, no weights) is read whole with torch.load(weights_only=True), as the load reads it.
"""
from __future__ import annotations

import json
import os
import zipfile

from hybridrl.config.schema import PPOConfig
from hybridrl.data.route import data_flow_switch
from hybridrl.utils.checkpoint_io import load_file

# config.json keys that decide the shapes of the weights a checkpoint holds.
ARCHITECTURE_KEYS = ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "intermediate_size", "tie_word_embeddings")
HF_CONFIG = os.path.join("huggingface", "config.json")
SHARD_DIRS = ("model", "optimizer")


def checkpoint_checked(config: PPOConfig) -> str | None:
    """The global_step_N directory resume_mode picks, or None (starting fresh, or a resume_path the other checks
    refuse already)."""
    from hybridrl.trainer.ppo.checkpointing import checkpoint_to_resume

    trainer = config.trainer
    if trainer.resume_mode == "resume_path" and not os.path.isdir(trainer.resume_from_path or ""):
        return None
    try:
        return checkpoint_to_resume(trainer)
    except (ValueError, FileNotFoundError):
        return None  # named by resume_path_problems


def resume_path_problems(config: PPOConfig) -> list[str]:
    """trainer.resume_from_path names a complete global_step_N directory."""
    from hybridrl.trainer.ppo.checkpointing import checkpoint_to_resume

    trainer = config.trainer
    if trainer.resume_mode != "resume_path" or not os.path.isdir(trainer.resume_from_path or ""):
        return []
    try:
        checkpoint_to_resume(trainer)
    except (ValueError, FileNotFoundError) as err:
        return [f"trainer.resume_from_path: expected a complete global_step_<N> checkpoint directory, got "
                f"{trainer.resume_from_path!r} ({err})"]
    return []


def checkpoint_problems(config: PPOConfig, step_dir: str) -> list[str]:
    """What makes `step_dir` unloadable by this run: another model, an incomplete file, another batch layout."""
    avoid = _how_to_avoid(config, step_dir)
    problems = []
    for role, model_path in _roles(config).items():
        role_dir = os.path.join(step_dir, role)
        if not os.path.isdir(role_dir):
            problems.append(f"{_key(config)}: expected {role_dir!r}, the {role}'s shards (this run trains a {role}), "
                            f"got no such directory (pruned by trainer.max_{role}_ckpt_to_keep, or saved by a run "
                            f"without a {role}); {avoid}")
            continue
        problems += [f"{_key(config)}: {problem}; {avoid}" for problem in _model_mismatch(role_dir, model_path)]
        problems += [f"{_key(config)}: {problem}; {avoid}" for problem in _incomplete_files(role_dir)]
    data_state = os.path.join(step_dir, "data.pt")
    if os.path.isfile(data_state) and not _complete_torch_file(data_state):
        problems.append(f"{_key(config)}: expected a complete checkpoint, got {data_state!r} cut short (not a "
                        f"complete torch file); {avoid}")
    elif os.path.isfile(data_state):
        problems += [f"{_key(config)}: {problem}; {avoid}" for problem in _data_state_mismatch(config, data_state)]
    changed = layout_changes(config, step_dir)
    if changed and not config.trainer.resume_accept_layout_change:
        problems.append(f"{_key(config)}: expected the batch layout {step_dir!r} was saved with, got {changed}; "
                        f"set them back, accept the change with trainer.resume_accept_layout_change=true, or {avoid}")
    return problems


def layout_warnings(config: PPOConfig, step_dir: str) -> list[str]:
    changed = layout_changes(config, step_dir)
    if not changed or not config.trainer.resume_accept_layout_change:
        return []
    return [f"{_key(config)}: resuming {step_dir!r} with another batch layout ({changed}), accepted by "
            f"trainer.resume_accept_layout_change=true: the data resumes at batch (not row) position, and the "
            f"saved optimizer state continues under the new sizes"]


def layout_changes(config: PPOConfig, step_dir: str) -> str:
    """`key=new (saved with old), ...` for each difference; "" when none or the checkpoint predates the file."""
    from hybridrl.trainer.ppo.checkpointing import LAYOUT_FILE, batch_layout

    path = os.path.join(step_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        return ""
    with open(path) as f:
        saved = json.load(f)
    now = batch_layout(config)
    return ", ".join(f"{key}={now[key]} (saved with {saved[key]})" for key in now
                     if key in saved and saved[key] != now[key])


def _key(config: PPOConfig) -> str:
    return "trainer.resume_from_path" if config.trainer.resume_mode == "resume_path" else "trainer.resume_mode"


def _how_to_avoid(config: PPOConfig, step_dir: str) -> str:
    if config.trainer.resume_mode == "resume_path":
        return "set trainer.resume_mode=disable to start fresh, or point trainer.resume_from_path at another step"
    return f"set trainer.resume_mode=disable to start fresh, or delete {step_dir} to resume from the one before"


def _roles(config: PPOConfig) -> dict[str, str]:
    roles = {"actor": config.actor_rollout_ref.model.path}
    if config.critic.enable:
        roles["critic"] = config.critic.model.path
    return roles


def _model_mismatch(role_dir: str, model_path: str) -> list[str]:
    saved_path, model_config = os.path.join(role_dir, HF_CONFIG), os.path.join(model_path, "config.json")
    if not (os.path.isfile(saved_path) and os.path.isfile(model_config)):
        return []  # an older checkpoint without the file; a missing model config is models/config_checks.py's
    saved, loaded = _read_json(saved_path), _read_json(model_config)
    if saved is None or loaded is None:
        return [f"expected a readable {saved_path!r}, got one that is not a JSON object"] if saved is None else []
    differ = [f"{key} {saved.get(key)!r} there, {loaded.get(key)!r} in {model_config!r}"
              for key in ARCHITECTURE_KEYS if saved.get(key) != loaded.get(key)]
    if not differ:
        return []
    return [f"expected a checkpoint of the model this run loads, got {role_dir!r} of another one ({'; '.join(differ)})"]


def _incomplete_files(role_dir: str) -> list[str]:
    problems = []
    for shard_dir in (os.path.join(role_dir, name) for name in SHARD_DIRS):
        problems += _short_shards(shard_dir)
    extra = os.path.join(role_dir, "extra")
    for name in sorted(os.listdir(extra)) if os.path.isdir(extra) else []:
        if not _complete_torch_file(os.path.join(extra, name)):
            problems.append(f"expected a complete checkpoint, got {os.path.join(extra, name)!r} cut short (not a "
                            f"complete torch file)")
    return problems


def _short_shards(shard_dir: str) -> list[str]:
    """Each file DCP's metadata lists reaches the end of the last item it holds there."""
    if not os.path.isfile(os.path.join(shard_dir, ".metadata")):
        return []
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(shard_dir).read_metadata()
    except Exception as err:  # unpickling a damaged file can raise anything
        return [f"expected a readable {os.path.join(shard_dir, '.metadata')!r}, got {type(err).__name__}: {err}"]
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        path = os.path.join(shard_dir, name)
        have = os.path.getsize(path) if os.path.isfile(path) else None
        if have is None or have < size:
            got = "missing" if have is None else f"{have} bytes"
            problems.append(f"expected a complete checkpoint, got {path!r} {got} where its metadata needs {size} "
                            f"bytes (cut short)")
    return problems


def _data_state_mismatch(config: PPOConfig, data_state: str) -> list[str]:
    """What in data.pt this run cannot take back (see the module docstring)."""
    saved, problem = _current_data_state(data_state)
    if problem is not None:
        return [problem]
    problems = []
    if config.algorithm.use_kl_in_reward and saved["kl_ctrl_in_reward_value"] is None:
        problems.append(f"expected the in-reward KL coefficient algorithm.use_kl_in_reward=true resumes, got "
                        f"{data_state!r} without one (saved by a run without it)")
    schedule = config.async_training.mode
    data_flow = data_flow_switch(config.data_flow.enable, config.algorithm.filter_groups.enable, schedule)
    held = saved.get("prompt_source") or {}
    # pending prompt rows (a batch read ahead: prompt_source.prefetch) are plain prompts every run takes back
    if data_flow is None and held.get("buffer"):
        problems.append(f"expected no work in flight in a checkpoint resumed without the data flow, got "
                        f"{data_state!r} holding groups in its prompt source's buffer, which this run would not "
                        f"resume as saved; resume it with the data flow (data_flow.enable, "
                        f"algorithm.filter_groups.enable or async_training.mode as it was saved)")
    # (an asynchronous schedule resumes a checkpoint without one with an empty source at the data's position)
    if data_flow is not None and schedule == "sync" and "prompt_source" not in saved:
        problems.append(f"expected the prompt source (sample buffer) that {data_flow} resumes, got {data_state!r} "
                        f"without one (saved by a run without the data flow: its batches would not resume exactly)")
    return problems


def _current_data_state(data_state: str) -> tuple[dict | None, str | None]:
    """(data.pt's dict, None), or (None, why it is not data.pt as this hybridrl writes it)."""
    from hybridrl.trainer.ppo.checkpointing import DATA_STATE_KEYS

    try:
        saved = load_file(data_state)
    except ValueError as err:  # a pickle that asks for code: named by load_file
        return None, str(err)
    if not isinstance(saved, dict):
        return None, (f"expected {data_state!r} to hold a dict with the keys {list(DATA_STATE_KEYS)}, got a "
                      f"{type(saved).__name__}")
    if "in_flight" in saved:
        return None, (f"expected data.pt of the current format (the work in flight in its prompt source), got "
                      f"{data_state!r} of the earlier format (its in-flight prompts listed under 'in_flight', "
                      f"written until 2026-12-01), which this hybridrl no longer reads")
    missing = [key for key in DATA_STATE_KEYS if key not in saved]
    if missing:
        return None, f"expected {data_state!r} to hold {list(DATA_STATE_KEYS)}, got it without {missing}"
    return saved, None


def _complete_torch_file(path: str) -> bool:
    """torch.save writes a zip archive: a file cut short loses the directory at its end."""
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            parsed = json.load(f)
    except (OSError, ValueError):
        return None
    return parsed if isinstance(parsed, dict) else None
