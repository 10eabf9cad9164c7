"""Check what a run reads and writes before Ray starts, so that a bad input fails in seconds and by name instead of
in a worker minutes later.

`check_before_start(config)` runs after `validate_config` (keys and values) and after the embedded default assets
are prepared. It reports every problem in one ConfigError, one `<key>: expected ..., got ...` line each:

  files      every configured file and model directory exists (validation.check_paths);
  data       each parquet file the run reads has a readable schema, rows, and the columns that the dataset and the
             reward manager read (data.prompt_key as chat messages, data.reward_fn_key, reward_model.ground_truth);
             the training files hold at least one batch. The validation files are not opened when the run never
             validates (trainer.val_before_train=false and trainer.test_freq <= 0). Only the files' footers are
             read; with data.custom_cls only whether they are readable parquet (the class decides the rest);
  models     config.json parses, the weights are there and every safetensors file is complete (its header is read,
             never its tensors);
  reward     custom_reward_function.name names a function of custom_reward_function.path;
  rollout    the tool and interaction YAMLs build; in async mode every agent-loop YAML entry's _target_ imports
             and the default agent loop is registered;
  resources  a local Ray has a CPU for every rank, and on CUDA a GPU;
  run dir    trainer.default_local_dir can be created and written (test-written here).

It returns warnings that do not stop the run: the free disk space under default_local_dir against one checkpoint
and against all the checkpoints the run keeps (trainer.max_*_ckpt_to_keep).
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from hybridrl.config.schema import PPOConfig
from hybridrl.config.validation import ConfigError, check_paths
from hybridrl.utils.disk import free_bytes, human_bytes
from hybridrl.utils.import_utils import NameNotDefined, load_extern_object
from hybridrl.utils.safetensors_header import UnreadableSafetensors, count_elements

# Checkpoint bytes per model parameter, by what checkpoint.save_contents holds: the actor and critic train fp32
# weights, and AdamW keeps two fp32 moments per trainable parameter. "extra" (LR schedule, RNG) is a few KiB.
CHECKPOINT_BYTES_PER_PARAMETER = {"model": 4, "optimizer": 8, "extra": 0}


def check_before_start(config: PPOConfig) -> list[str]:
    """Raise ConfigError listing every problem found (see the module docstring); return the warnings."""
    problems = _missing_paths(config)
    train_rows = _check_data(config, problems)
    parameters = _check_models(config, problems)
    _check_reward_function(config, problems)
    _check_multi_turn_files(config, problems)
    _check_agent_loops(config, problems)
    _check_resources(config, problems)
    _check_tensor_parallel_heads(config, problems)
    _check_run_dir(config.trainer.default_local_dir, problems)
    if problems:
        raise ConfigError(problems)
    return _disk_space_warnings(config, train_rows, parameters)


def _missing_paths(config: PPOConfig) -> list[str]:
    try:
        check_paths(config)
    except ConfigError as err:
        return err.problems
    return []


# ---- rollout: tools, interactions, agent loops ----

def _check_multi_turn_files(config: PPOConfig, problems: list[str]) -> None:
    """Build the tools of multi_turn.tool_config_path and the interactions of multi_turn.interaction_config_path
    here, as each agent-loop worker will: a missing class or an invalid schema is refused now, naming the file and
    the entry (the registries' messages)."""
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable:
        return
    from hybridrl.interactions import initialize_interactions_from_config
    from hybridrl.tools import initialize_tools_from_config

    for key, build, expected in (("tool_config_path", initialize_tools_from_config, "a tool YAML"),
                                 ("interaction_config_path", initialize_interactions_from_config,
                                  "an interaction YAML")):
        path = getattr(multi_turn, key)
        if path is None:
            continue
        try:
            build(path)
        except Exception as err:  # the registries name file and entry; a class's own __init__ can raise anything
            problems.append(f"actor_rollout_ref.rollout.multi_turn.{key}: expected {expected} whose every entry "
                            f"builds, got {path!r}: {err}")


def _check_agent_loops(config: PPOConfig, problems: list[str]) -> None:
    """Import every _target_ of the agent-loop YAML and find the default loop, as the agent-loop workers will: a
    module or class that does not import is refused now, not after the cluster is up."""
    agent = config.actor_rollout_ref.rollout.agent
    if config.actor_rollout_ref.rollout.mode != "async":
        return
    from hybridrl.agent_loop.base import load_agent_loop_config

    try:
        registry = load_agent_loop_config(agent.agent_loop_config_path)
    except Exception as err:  # names the file and the entry
        problems.append(f"actor_rollout_ref.rollout.agent.agent_loop_config_path: expected a YAML whose every "
                        f"_target_ imports, got {agent.agent_loop_config_path!r}: {err}")
        return
    if agent.default_agent_loop not in registry:
        problems.append(f"actor_rollout_ref.rollout.agent.default_agent_loop: expected a registered agent loop "
                        f"(one of {sorted(registry)}), got {agent.default_agent_loop!r}")


# ---- data ----

def _check_data(config: PPOConfig, problems: list[str]) -> int | None:
    """Check the data files the run reads; return the training rows batches are drawn from (None when unknown)."""
    data = config.data
    train_rows = _check_data_files("data.train_files", data.train_files, config, problems)
    if config.trainer.runs_validation():
        _check_data_files("data.val_files", data.val_files, config, problems)
    if train_rows is None or data.custom_cls.path:
        return None
    total = sum(rows for _, rows in train_rows)
    usable = total if data.train_max_samples == -1 else min(total, data.train_max_samples)
    if usable < data.train_batch_size:
        counts = ", ".join(f"{path}: {rows}" for path, rows in train_rows)
        kept = "" if usable == total else f", of which data.train_max_samples={data.train_max_samples} are used"
        problems.append(f"data.train_files: expected at least data.train_batch_size={data.train_batch_size} rows in "
                        f"all (one training batch), got {total} ({counts}{kept})")
    return usable


def _check_data_files(key: str, paths: list[str], config: PPOConfig,
                      problems: list[str]) -> list[tuple[str, int]] | None:
    """(file, rows) of each file; None when one of them is missing or unreadable (its problem is then reported)."""
    rows: list[tuple[str, int]] | None = []
    for index, path in enumerate(paths):
        where = f"{key}[{index}]"
        if not os.path.isfile(path):  # check_paths reported it
            rows = None
            continue
        try:
            metadata = pq.read_metadata(path)
            schema = metadata.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as err:
            problems.append(f"{where}: expected a readable parquet file, got {path!r} ({type(err).__name__}: {err})")
            rows = None
            continue
        if metadata.num_rows == 0:
            problems.append(f"{where}: expected a parquet file with rows, got {path!r} (0 rows)")
        if not config.data.custom_cls.path:
            _check_columns(where, path, schema, config, problems)
        if rows is not None:
            rows.append((path, metadata.num_rows))
    return rows


def _check_columns(where: str, path: str, schema: pa.Schema, config: PPOConfig, problems: list[str]) -> None:
    """The columns RLHFDataset and the reward manager read, present and of a usable type."""
    prompt, source = config.data.prompt_key, config.data.reward_fn_key
    required = {prompt: "data.prompt_key", source: "data.reward_fn_key"}
    manager = config.reward_model.reward_manager
    if _reads_ground_truth(manager):
        required["reward_model"] = f"its ground_truth is read by reward_model.reward_manager={manager!r}"
    for column, why in required.items():
        if column not in schema.names:
            problems.append(f"{where}: expected a column {column!r} ({why}), got {path!r} with columns {schema.names}")
    if prompt in schema.names and not _is_chat(schema.field(prompt).type):
        problems.append(f"{where}: expected column {prompt!r} (data.prompt_key) to hold chat messages, a list of "
                        f"{{role, content}}, got type {schema.field(prompt).type} in {path!r}")
    if "reward_model" in required and "reward_model" in schema.names \
            and not _has_ground_truth(schema.field("reward_model").type):
        problems.append(f"{where}: expected column 'reward_model' to be a struct with a 'ground_truth' field, got "
                        f"type {schema.field('reward_model').type} in {path!r}")


def _reads_ground_truth(manager_name: str) -> bool:
    """Every manager built on RewardManagerBase (naive, batch, dapo) reads reward_model.ground_truth."""
    from hybridrl.reward.managers import RewardManagerBase, get_reward_manager_cls

    return issubclass(get_reward_manager_cls(manager_name), RewardManagerBase)


def _is_chat(column_type: pa.DataType) -> bool:
    if not (pa.types.is_list(column_type) or pa.types.is_large_list(column_type)):
        return False
    message = column_type.value_type
    return pa.types.is_struct(message) and {"role", "content"} <= {field.name for field in message}


def _has_ground_truth(column_type: pa.DataType) -> bool:
    """A struct with the field, or a map (whose keys the footer does not tell)."""
    if pa.types.is_map(column_type):
        return True
    return pa.types.is_struct(column_type) and "ground_truth" in {field.name for field in column_type}


# ---- models ----

def _check_tensor_parallel_heads(config: PPOConfig, problems: list[str]) -> None:
    """A tensor-parallel engine splits the attention heads over its GPUs: their count must divide by the size
    (the engine would refuse at start, on every rank, after the trainer had loaded)."""
    tp = config.actor_rollout_ref.rollout.tensor_model_parallel_size
    path = os.path.join(config.actor_rollout_ref.model.path, "config.json")
    if tp == 1 or config.actor_rollout_ref.rollout.name == "hf" or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            model = json.load(f)
        heads = model.get("text_config", model)["num_attention_heads"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # _check_model_dir reports an unreadable config.json
    if heads % tp:
        problems.append(f"actor_rollout_ref.rollout.tensor_model_parallel_size: expected a divisor of the model's "
                        f"num_attention_heads ({heads}, {path}), got {tp}")


def _model_dirs(config: PPOConfig) -> dict[str, str]:
    """The model directories the run loads, by the key that names each."""
    dirs = {"actor_rollout_ref.model.path": config.actor_rollout_ref.model.path}
    if config.critic.enable:
        dirs["critic.model.path"] = config.critic.model.path
    if config.reward_model.enable:
        dirs["reward_model.model.path"] = config.reward_model.model.path
    return dirs


def _check_models(config: PPOConfig, problems: list[str]) -> dict[str, int | None]:
    """Check each model directory once; return its parameter count by key (None when not read from safetensors)."""
    by_dir: dict[str, int | None] = {}
    parameters = {}
    for key, path in _model_dirs(config).items():
        if path not in by_dir:
            by_dir[path] = _check_model_dir(key, path, problems)
        parameters[key] = by_dir[path]
    return parameters


def _check_model_dir(key: str, path: str, problems: list[str]) -> int | None:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):  # check_paths reported it
        return None
    try:
        with open(config_path) as f:
            parsed = json.load(f)
        if not isinstance(parsed, dict):
            raise ValueError(f"a JSON {type(parsed).__name__}, not an object")
    except (OSError, ValueError) as err:
        problems.append(f"{key}: expected a model directory whose config.json is a JSON object, got {config_path!r} "
                        f"({err})")
    weights = _safetensors_files(key, path, problems)
    if weights is None:
        return None
    counts = [_count_parameters(key, weight, problems) for weight in weights]
    return None if None in counts else sum(counts)


def _count_parameters(key: str, weight_file: str, problems: list[str]) -> int | None:
    try:
        return count_elements(weight_file)
    except UnreadableSafetensors as err:
        problems.append(f"{key}: expected complete safetensors weights, got {weight_file!r} ({err})")
        return None


def _safetensors_files(key: str, path: str, problems: list[str]) -> list[str] | None:
    """The safetensors files transformers loads from `path`, in its order of preference; None when the weights are
    torch pickles (nothing to read cheaply) or missing (a problem)."""
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return [os.path.join(path, "model.safetensors")]
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            problems.append(f"{key}: expected a safetensors index with a weight_map, got {index_path!r} ({err!r})")
            return None
        return [os.path.join(path, shard) for shard in shards]
    pickled = ("pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any(os.path.isfile(os.path.join(path, name)) for name in pickled):
        problems.append(f"{key}: expected model weights (model.safetensors, model.safetensors.index.json or "
                        f"pytorch_model.bin) in the directory, got {path!r} without any")
    return None


# ---- reward function, resources, run directory ----

def _check_reward_function(config: PPOConfig, problems: list[str]) -> None:
    """Run the user's reward file here, as the reward manager will, and look the function up by name."""
    path, name = config.custom_reward_function.path, config.custom_reward_function.name
    if path is None or not os.path.isfile(path):  # unset, or reported by check_paths
        return
    try:
        function = load_extern_object(path, name)
    except NameNotDefined as err:
        problems.append(f"custom_reward_function.name: expected a function defined in custom_reward_function.path, "
                        f"got {name!r} ({err})")
        return
    except Exception as err:  # running the user's file can raise anything
        problems.append(f"custom_reward_function.path: expected a Python file that runs, got {path!r} "
                        f"({type(err).__name__}: {err})")
        return
    if not callable(function):
        problems.append(f"custom_reward_function.name: expected a function, got {name!r}, which is a "
                        f"{type(function).__name__} in {path}")


def _check_resources(config: PPOConfig, problems: list[str]) -> None:
    """A local Ray gets ray_init.num_cpus (default: the CPUs Ray detects) and the visible GPUs; each rank takes one
    CPU, and one GPU on CUDA. A running cluster (ray_init.address) is checked once joined (RayResourcePool)."""
    if config.ray_init.address is not None:
        return
    from hybridrl.single_controller.resource_pool_manager import pool_specs

    trainer = config.trainer
    specs = pool_specs(config)  # the rollout's own pool too with actor_rollout_ref.hybrid_engine=false
    ranks = sum(spec.world_size for spec in specs.values())
    got = " + ".join(f"{spec.where} = {spec.nnodes} * {spec.processes_per_node}" for spec in specs.values()) \
        + f" = {ranks}"
    cpus = config.ray_init.num_cpus or _cpus_ray_detects()
    cpus_from = "ray_init.num_cpus" if config.ray_init.num_cpus else "ray_init.num_cpus=null: the CPUs Ray detects"
    if ranks > cpus:
        problems.append(f"trainer.n_gpus_per_node: expected at most {cpus} ranks in all (one CPU each; the local "
                        f"Ray has {cpus} CPUs, {cpus_from}), got {got}")
    gpus = _visible_gpus()
    if (trainer.device == "cuda" or (trainer.device == "auto" and gpus > 0)) and ranks > gpus:
        problems.append(f"trainer.n_gpus_per_node: expected at most {gpus} ranks in all (one GPU each with "
                        f"trainer.device={trainer.device!r}; {gpus} GPUs are visible), got {got}")


def _cpus_ray_detects() -> int:
    """The CPUs a local Ray will count: those this process may run on, capped by a cgroup-v2 CPU quota.

    Read here without importing `ray`: the driver must import it only once run_ppo has put it in its
    single-machine mode (single_controller/local_cluster.py)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _check_run_dir(path: str, problems: list[str]) -> None:
    """Create the directory and write, flush and remove a small file in it, as the first checkpoint would."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_") as probe:
            probe.write(b"hybridrl")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as err:
        problems.append(f"trainer.default_local_dir: expected a directory this process can create and write "
                        f"(checkpoints, metrics and summary.json go there), got {path!r} ({err})")


# ---- disk space ----

@dataclass
class _SavedRole:
    """One model a checkpoint holds (the actor, the critic) and how many of its checkpoints are kept."""
    model_key: str
    parameters: int | None  # None: not read from safetensors, so its size is unknown
    bytes_per_parameter: int
    keep_key: str
    keep: int | None  # None keeps all (verl's default)

    @property
    def checkpoint_bytes(self) -> int:
        return self.parameters * self.bytes_per_parameter

    def held_at_once(self, saves: int) -> int:
        """A save is published before the old ones are pruned: keep + 1 exist for a moment."""
        return saves if self.keep is None else min(saves, self.keep + 1)


def _disk_space_warnings(config: PPOConfig, train_rows: int | None, parameters: dict[str, int | None]) -> list[str]:
    """Warn when one checkpoint, or all the checkpoints the run holds at once, will not fit in the free space."""
    trainer = config.trainer
    roles = _saved_roles(config, parameters)
    if trainer.save_freq <= 0 or any(role.parameters is None for role in roles):
        return []
    path, free = trainer.default_local_dir, free_bytes(trainer.default_local_dir)
    one = sum(role.checkpoint_bytes for role in roles)
    if one > free:
        sizes = "; ".join(f"{role.model_key}: {role.parameters / 1e6:.2f}M parameters x {role.bytes_per_parameter} B"
                          for role in roles)
        return [f"trainer.default_local_dir: one checkpoint needs about {human_bytes(one)} ({sizes}), but {path!r} "
                f"has {human_bytes(free)} free: the first save (step {trainer.save_freq}) will fail"]
    saves = _number_of_saves(config, train_rows)
    if saves is None:
        return []
    peak = sum(role.held_at_once(saves) * role.checkpoint_bytes for role in roles)
    if peak <= free:
        return []
    keeps = ", ".join(f"{role.keep_key}={'null: all' if role.keep is None else role.keep}" for role in roles)
    return [f"trainer.default_local_dir: this run saves {saves} checkpoints (trainer.save_freq={trainer.save_freq}) "
            f"and holds up to {max(role.held_at_once(saves) for role in roles)} at once ({keeps}), about "
            f"{human_bytes(peak)} at {human_bytes(one)} each, but {path!r} has {human_bytes(free)} free; lower "
            f"{' and '.join(role.keep_key for role in roles)} or free space, or saves will fail with 'No space left "
            f"on device'"]


def _saved_roles(config: PPOConfig, parameters: dict[str, int | None]) -> list[_SavedRole]:
    actor, critic, trainer = config.actor_rollout_ref, config.critic, config.trainer
    roles = [_SavedRole("actor_rollout_ref.model.path", parameters.get("actor_rollout_ref.model.path"),
                        _bytes_per_parameter(actor.actor.checkpoint.save_contents, actor.model.lora_rank),
                        "trainer.max_actor_ckpt_to_keep", trainer.max_actor_ckpt_to_keep)]
    if critic.enable:
        roles.append(_SavedRole("critic.model.path", parameters.get("critic.model.path"),
                                _bytes_per_parameter(critic.checkpoint.save_contents, critic.model.lora_rank),
                                "trainer.max_critic_ckpt_to_keep", trainer.max_critic_ckpt_to_keep))
    return roles


def _bytes_per_parameter(save_contents: list[str], lora_rank: int) -> int:
    """Under LoRA the optimizer holds only the adapters' moments: not counted."""
    return sum(CHECKPOINT_BYTES_PER_PARAMETER[content] for content in save_contents
               if not (content == "optimizer" and lora_rank > 0))


def _number_of_saves(config: PPOConfig, train_rows: int | None) -> int | None:
    """Saves every save_freq steps and at the last step; None when the number of steps depends on unknown rows."""
    trainer = config.trainer
    steps = trainer.total_training_steps
    if steps is None:
        if train_rows is None:
            return None
        steps = train_rows // config.data.train_batch_size * trainer.total_epochs
    return steps // trainer.save_freq + (1 if steps % trainer.save_freq else 0)
