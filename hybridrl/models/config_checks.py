"""Config checks of the models: liger kernels, LoRA, CPU offload, and before the start the model directories
(config.json, complete safetensors weights) and the policy's tokenizer folder (its files and a chat template),
registered with hybridrl.config.checks."""
from __future__ import annotations

import functools
import importlib.util
import json
import os

from hybridrl.config.checks import Values, critic_enabled, register_check
from hybridrl.config.schema import PPOConfig
from hybridrl.utils.safetensors_header import UnreadableSafetensors, count_elements, safetensors_files

INSTALL_GPU_EXTRAS = "pip install -e '.[gpu]'"
# The files one of which holds a tokenizer's vocabulary: without any, transformers builds an empty tokenizer from
# config.json alone, and the run died 21 s in with "chat_template is not set" (issue 64).
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def cuda_available() -> bool:
    import torch  # imported only when a rule needs it: torch takes seconds to import

    return torch.cuda.is_available()


@register_check()
def _liger_runs_on_a_gpu(values: Values, problems: list[str]) -> None:
    """liger's kernels are Triton kernels: CUDA only, and the package comes with the gpu extra."""
    if not values("actor_rollout_ref.model.use_liger"):
        return
    device = values("trainer.device")
    if device == "cpu" or (values("ray_init.address") is None and not cuda_available()):
        problems.append(f"actor_rollout_ref.model.use_liger: expected false without a GPU (liger's kernels run only "
                        f"on CUDA; trainer.device={device!r}, CUDA available: {cuda_available()}), got True")
    elif importlib.util.find_spec("liger_kernel") is None:
        problems.append(f"actor_rollout_ref.model.use_liger: expected the liger-kernel package to be installed "
                        f"({INSTALL_GPU_EXTRAS}), got True (liger_kernel is not importable)")


@register_check()
def _lora_settings(values: Values, problems: list[str]) -> None:
    rank = values("actor_rollout_ref.model.lora_rank")
    adapter = values("actor_rollout_ref.model.lora_adapter_path")
    if rank == 0 and adapter is not None:
        problems.append(f"actor_rollout_ref.model.lora_adapter_path: expected null when "
                        f"actor_rollout_ref.model.lora_rank=0 (no LoRA to load the adapter into), got {adapter!r}")


# Models whose state param_offload / optimizer_offload park on the CPU between phases (models/offload.py):
# (strategy key, fsdp_config key, its parking flags, whether that fsdp_config has offload_policy).
OFFLOAD_FLAGS = (
    ("actor_rollout_ref.actor.strategy", "actor_rollout_ref.actor.fsdp_config", ("param_offload", "optimizer_offload"),
     True),
    ("actor_rollout_ref.ref.strategy", "actor_rollout_ref.ref.fsdp_config", ("param_offload",), False),
    ("critic.strategy", "critic.model.fsdp_config", ("param_offload", "optimizer_offload"), True),
)


@register_check()
def _offload_settings(values: Values, problems: list[str]) -> None:
    """Parking between phases moves FSDP2's sharded DTensors; FSDP1 has its own permanent CPU offload
    (offload_policy, torch's CPUOffload), and offload_policy already keeps everything on the CPU."""
    for strategy_key, fsdp_key, flags, has_policy in OFFLOAD_FLAGS:
        if strategy_key.startswith("critic.") and not critic_enabled(values):
            continue
        for flag in flags:
            key = f"{fsdp_key}.{flag}"
            if not values(key):
                continue
            if values(strategy_key) == "fsdp":
                instead = (f"set {fsdp_key}.offload_policy=true (FSDP1's own CPUOffload: parameters, gradients and "
                           f"optimizer state on the CPU all the time) or {strategy_key}=fsdp2" if has_policy
                           else f"set {strategy_key}=fsdp2")
                problems.append(f"{key}: expected False with {strategy_key}='fsdp' (parking state on the CPU between "
                                f"phases is implemented for fsdp2 only; {instead}), got True")
            elif has_policy and values(f"{fsdp_key}.offload_policy"):
                problems.append(f"{key}: expected False with {fsdp_key}.offload_policy=true (that keeps parameters, "
                                f"gradients and optimizer state on the CPU all the time; {flag} parks them there "
                                f"between phases only: choose one), got True")
    ref_key = "actor_rollout_ref.ref.fsdp_config.param_offload"
    actor_key = "actor_rollout_ref.actor.fsdp_config.param_offload"
    if values("actor_rollout_ref.model.lora_rank") > 0 and values(ref_key) and not values(actor_key):
        problems.append(f"{ref_key}: expected False when {actor_key}=false and actor_rollout_ref.model.lora_rank > 0 "
                        f"(the LoRA reference is the actor's own module with its adapters disabled, so it is parked "
                        f"exactly when the actor is), got True")


@register_check("paths")
def _model_dirs_exist(config: PPOConfig, problems: list[str]) -> None:
    for key, path in _model_dirs(config).items():
        _expect_model_dir(key, path, problems)
    adapter = config.actor_rollout_ref.model.lora_adapter_path
    if config.actor_rollout_ref.model.lora_rank > 0 and adapter is not None \
            and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        problems.append(f"actor_rollout_ref.model.lora_adapter_path: expected a peft adapter directory containing "
                        f"adapter_config.json, got {adapter!r}")


def _expect_model_dir(key: str, path: str, problems: list[str]) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        problems.append(f"{key}: expected a local model directory containing config.json, got {path!r}")


def _model_dirs(config: PPOConfig) -> dict[str, str]:
    """The model directories the run loads, by the key that names each."""
    dirs = {"actor_rollout_ref.model.path": config.actor_rollout_ref.model.path}
    if config.critic.enable:
        dirs["critic.model.path"] = config.critic.model.path
    if config.reward_model.enable:
        dirs["reward_model.model.path"] = config.reward_model.model.path
    return dirs


@register_check("preflight")
def _check_model_dirs(config: PPOConfig, problems: list[str]) -> None:
    _check_models(config, problems)


def parameter_counts(config: PPOConfig) -> dict[str, int | None]:
    """The parameter count of each model directory by key (None when not read from safetensors), for the disk-space
    warning; it runs only when the preflight found no problem, so _check_model_dirs reported nothing here."""
    return _check_models(config, [])


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
    if not os.path.isfile(config_path):  # _model_dirs_exist reported it
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
    try:
        files = safetensors_files(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        index_path = os.path.join(path, "model.safetensors.index.json")
        problems.append(f"{key}: expected a safetensors index with a weight_map, got {index_path!r} ({err!r})")
        return None
    if files is not None:
        return files
    pickled = ("pytorch_model.bin", "pytorch_model.bin.index.json")
    if not any(os.path.isfile(os.path.join(path, name)) for name in pickled):
        problems.append(f"{key}: expected model weights (model.safetensors, model.safetensors.index.json or "
                        f"pytorch_model.bin) in the directory, got {path!r} without any")
    return None


@register_check("preflight")
def _check_policy_tokenizer(config: PPOConfig, problems: list[str]) -> None:
    """Its files (tokenizer_folder_problems), then it loads, as the trainer will load it."""
    found = tokenizer_folder_problems(config)
    if not found and _config_json_parses(tokenizer_folder(config)[1]):
        try:
            _load_policy_tokenizer(config)
        except Exception as err:  # transformers and a remote-code tokenizer can raise anything
            key, folder = tokenizer_folder(config)
            found.append(f"{key}: expected a tokenizer transformers can load, got {folder!r} "
                         f"({type(err).__name__}: {err})")
    problems += found


def checked_policy_tokenizer(config: PPOConfig):
    """The run's policy tokenizer for the row checks, or None when _check_policy_tokenizer or _check_model_dirs
    reports a problem with it."""
    if tokenizer_folder_problems(config) or not _config_json_parses(tokenizer_folder(config)[1]):
        return None
    try:
        return _load_policy_tokenizer(config)
    except Exception:  # reported by _check_policy_tokenizer
        return None


def _load_policy_tokenizer(config: PPOConfig):
    """Loaded once for both checks (Qwen's takes about 2 s)."""
    model = config.actor_rollout_ref.model
    return _cached_tokenizer(tokenizer_folder(config)[1], model.trust_remote_code, model.custom_chat_template)


@functools.lru_cache(maxsize=2)
def _cached_tokenizer(folder: str, trust_remote_code: bool, custom_chat_template: str | None):
    from hybridrl.utils.tokenizer import load_tokenizer

    return load_tokenizer(folder, trust_remote_code=trust_remote_code, custom_chat_template=custom_chat_template)


def _config_json_parses(folder: str) -> bool:
    """A folder without config.json (a tokenizer folder) passes; a broken one is _check_model_dir's to report."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return True
    try:
        with open(path) as f:
            return isinstance(json.load(f), dict)
    except (OSError, ValueError):
        return False


def tokenizer_folder(config: PPOConfig) -> tuple[str, str]:
    """(key, folder) of the policy's tokenizer: data.tokenizer, else the policy's own (utils/tokenizer.py)."""
    if config.data.tokenizer is not None:
        return "data.tokenizer", config.data.tokenizer
    return "actor_rollout_ref.model.path", config.actor_rollout_ref.model.path


def tokenizer_folder_problems(config: PPOConfig) -> list[str]:
    """The policy tokenizer's folder holds a vocabulary, and a chat template unless
    actor_rollout_ref.model.custom_chat_template gives one: the dataset renders every prompt with it. Files only:
    nothing is loaded here (the row checks load the tokenizer once these pass)."""
    key, folder = tokenizer_folder(config)
    if not os.path.isdir(folder):  # a missing model directory is _model_dirs_exist's to report
        return [f"{key}: expected a tokenizer folder, got {folder!r} (no such directory)"] \
            if key == "data.tokenizer" else []
    present = set(os.listdir(folder))
    remote_code = config.actor_rollout_ref.model.trust_remote_code  # its own files (tiktoken, ...): the load decides
    if not remote_code and not present & set(TOKENIZER_VOCAB_FILES):
        return [f"{key}: expected the tokenizer's files in {folder!r} (one of {', '.join(TOKENIZER_VOCAB_FILES)}, "
                f"with tokenizer_config.json), got none of them (files there: {sorted(present)}); copy the "
                f"tokenizer next to the model, or set data.tokenizer to a folder that has it"]
    if config.actor_rollout_ref.model.custom_chat_template is None and not _has_chat_template(folder, present):
        return [f"{key}: expected a chat template in {folder!r} (chat_template.jinja, chat_template.json, or "
                f"\"chat_template\" in tokenizer_config.json: the dataset renders every prompt with it), got none; "
                f"use the instruct model's tokenizer, or set actor_rollout_ref.model.custom_chat_template"]
    return []


def _has_chat_template(folder: str, present: set[str]) -> bool:
    if present & set(CHAT_TEMPLATE_FILES):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def max_position_embeddings(config: PPOConfig) -> int | None:
    """The policy's max_position_embeddings from its config.json (None when it has none or is unreadable: reported
    by _check_model_dirs)."""
    try:
        with open(os.path.join(config.actor_rollout_ref.model.path, "config.json")) as f:
            value = json.load(f).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None


# The sections with verl's Ulysses sequence parallelism (models/sequence_parallel.py); they share the policy model.
SEQUENCE_PARALLEL_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref")


@register_check()
def _sequence_parallel_settings(values: Values, problems: list[str]) -> None:
    """A sequence-parallel group is P consecutive ranks of the policy's pool, splitting a packed row."""
    nnodes, gpus = values("trainer.nnodes"), values("trainer.n_gpus_per_node")
    for role in SEQUENCE_PARALLEL_ROLES:
        key = f"{role}.ulysses_sequence_parallel_size"
        size = values(key)
        if size == 1:
            continue
        if nnodes * gpus % size:
            problems.append(f"{key}: expected a divisor of the world size trainer.nnodes * trainer.n_gpus_per_node = "
                            f"{nnodes} * {gpus} = {nnodes * gpus} (groups of consecutive ranks), got {size}")
        if not values("actor_rollout_ref.model.use_remove_padding"):
            problems.append(f"{key}: expected 1 with actor_rollout_ref.model.use_remove_padding=false (the ranks of a "
                            f"group split one packed row; set use_remove_padding=true, as verl requires), got {size}")
        if values("actor_rollout_ref.model.use_fused_kernels"):
            problems.append(f"{key}: expected 1 with actor_rollout_ref.model.use_fused_kernels=true (the fused "
                            f"log-prob forward has no sequence-parallel form here), got {size}")


@register_check("preflight")
def _sequence_parallel_fits_the_model(config: PPOConfig, problems: list[str]) -> None:
    """Each rank of a group attends with heads / P query heads and key/value heads / P key/value heads, through
    transformers' attention interface, which the model class must call."""
    sizes = {role: getattr(config.actor_rollout_ref, role.rsplit(".", 1)[1]).ulysses_sequence_parallel_size
             for role in SEQUENCE_PARALLEL_ROLES}
    if all(size == 1 for size in sizes.values()):
        return
    try:
        with open(os.path.join(config.actor_rollout_ref.model.path, "config.json")) as f:
            model_config = json.load(f)
        heads = model_config["num_attention_heads"]
        kv_heads = model_config.get("num_key_value_heads") or heads
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # an unreadable config.json: _check_model_dirs reports it
    takes_attention_backend = _model_class_takes_attention_backend(model_config.get("model_type"))
    for role, size in sizes.items():
        key = f"{role}.ulysses_sequence_parallel_size"
        if size == 1:
            continue
        for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if count % size:
                problems.append(f"{key}: expected a divisor of the model's {name} = {count} "
                                f"(actor_rollout_ref.model.path config.json), got {size}")
        if not takes_attention_backend:
            problems.append(f"{key}: expected 1 for model_type {model_config.get('model_type')!r}, whose transformers "
                            f"class does not call transformers' attention interface (sequence parallelism hooks "
                            f"attention there), got {size}")


def _model_class_takes_attention_backend(model_type: str | None) -> bool:
    """Whether transformers' causal-LM class for `model_type` runs attention through AttentionInterface."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    model_class = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
    return bool(getattr(model_class, "_supports_attention_backend", False))
