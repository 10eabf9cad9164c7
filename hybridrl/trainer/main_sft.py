"""Entry point: `python -m hybridrl.trainer.main_sft [a.b=c ...]` fine-tunes a causal LM on chat conversations.

Wiring only: Hydra composes hybridrl/config/sft_trainer.yaml with the overrides, `validate_sft_config`
turns it into a typed SFTConfig (or prints one `config error:` line per problem and exits with code 2),
then `run_sft` starts the ranks and returns the directory of the saved HF model.

How ranks start. On its own, this command launches `trainer.n_gpus_per_node` local processes with
torch's elastic launcher (the library behind `torchrun`) called as a function: no Ray is needed for
a single-program data-parallel job, a failing rank stops the others and its traceback is reported
in the parent, and `run_sft` can be called from Python (the embedded default's preparation does,
before any Ray cluster exists). Started by `torchrun` instead (TORCHELASTIC_RUN_ID is set), as verl's SFT
is, it runs as that one rank: `torchrun --nnodes N --nproc_per_node G -m hybridrl.trainer.main_sft ...`
is how to use several nodes.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Literal, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from hybridrl.config.cli_errors import exit_with_config_errors, run_hydra_cli
from hybridrl.config.compose import CONFIG_DIR
from hybridrl.config.schema import ConfigNode, at_least, between, one_or_list, positive
from hybridrl.config.structure import build, check_structure, to_plain
from hybridrl.config.validation import ConfigError
from hybridrl.trainer.tracking import VALID_LOGGERS



# ---- typed config: one dataclass per YAML mapping of sft_trainer.yaml, defaults only in the YAML ----

@dataclass
class SFTMultiturnConfig(ConfigNode):
    enable: bool
    messages_key: str


@dataclass
class SFTDataConfig(ConfigNode):
    train_files: list[str] = one_or_list()
    val_files: Optional[list[str]] = one_or_list()
    multiturn: SFTMultiturnConfig
    max_length: int = positive()
    truncation: Literal["error", "left", "right"]
    train_batch_size: int = positive()
    micro_batch_size_per_gpu: int = positive()


@dataclass
class SFTModelConfig(ConfigNode):
    partial_pretrain: str
    trust_remote_code: bool
    enable_gradient_checkpointing: bool
    strategy: Literal["fsdp", "fsdp2"]


@dataclass
class SFTOptimConfig(ConfigNode):
    lr: float = positive()
    betas: list[float]
    weight_decay: float = at_least(0)
    warmup_steps_ratio: float = between(0, 1)
    clip_grad: float = positive()
    lr_scheduler: Literal["cosine", "constant"]


@dataclass
class SFTTrainerConfig(ConfigNode):
    default_local_dir: str
    project_name: str
    experiment_name: str
    total_epochs: int = positive()
    total_training_steps: Optional[int] = positive()
    test_freq: int
    logger: list[str] = one_or_list()
    seed: int
    nnodes: int = positive()
    n_gpus_per_node: int = positive()
    device: Literal["auto", "cuda", "cpu"]


@dataclass
class SFTConfig(ConfigNode):
    """The whole SFT job, as `python -m hybridrl.trainer.main_sft` composes it."""
    cache_dir: str
    data: SFTDataConfig
    model: SFTModelConfig
    optim: SFTOptimConfig
    trainer: SFTTrainerConfig


def validate_sft_config(cfg: DictConfig) -> SFTConfig:
    """The typed config, or ConfigError listing every problem (key: expected ..., got ...), files included."""
    problems: list[str] = []
    checked = check_structure(SFTConfig, to_plain(cfg, "", problems, {}), "", problems)
    if problems:
        raise ConfigError(problems)
    config = build(SFTConfig, checked)
    _check_rules(config, problems)
    if problems:
        raise ConfigError(problems)
    return config


def _check_rules(config: SFTConfig, problems: list[str]) -> None:
    data, trainer = config.data, config.trainer
    if not data.multiturn.enable:
        problems.append("data.multiturn.enable: expected true (rows of chat messages), got false; single-turn "
                        "prompt/response rows are not supported: write them as messages "
                        "(examples/data_preprocess/sft_from_rl.py does it for RL parquet)")
    if len(config.optim.betas) != 2:
        problems.append(f"optim.betas: expected two floats, got {config.optim.betas}")
    unknown_loggers = [name for name in trainer.logger if name not in VALID_LOGGERS]
    if unknown_loggers:
        problems.append(f"trainer.logger: expected names from {list(VALID_LOGGERS)}, got {unknown_loggers}")
    if trainer.test_freq != -1 and trainer.test_freq <= 0:
        problems.append(f"trainer.test_freq: expected -1 (only after the last step) or > 0, got {trainer.test_freq}")
    if trainer.device == "cuda" and not torch.cuda.is_available():
        problems.append("trainer.device: expected a device this machine has, got 'cuda' (no GPU visible)")
    world_size = trainer.nnodes * trainer.n_gpus_per_node
    if data.train_batch_size % world_size:
        problems.append(f"data.train_batch_size: expected a multiple of the {world_size} ranks "
                        f"(trainer.nnodes x trainer.n_gpus_per_node), got {data.train_batch_size}")
    elif (data.train_batch_size // world_size) % data.micro_batch_size_per_gpu:
        problems.append(f"data.micro_batch_size_per_gpu: expected a divisor of the per-rank batch "
                        f"{data.train_batch_size // world_size} (data.train_batch_size / ranks), "
                        f"got {data.micro_batch_size_per_gpu}")
    for key, files in (("data.train_files", data.train_files), ("data.val_files", data.val_files or [])):
        for index, path in enumerate(files):
            if not os.path.isfile(path):
                problems.append(f"{key}[{index}]: expected an existing parquet file, got {path!r} (no such file)")
    if not os.path.isfile(os.path.join(config.model.partial_pretrain, "config.json")):
        problems.append(f"model.partial_pretrain: expected a local model directory containing config.json, "
                        f"got {config.model.partial_pretrain!r}")
    cache_dir = os.path.abspath(config.cache_dir)
    if any(cache_dir in problem for problem in problems):  # a missing file of the embedded default
        problems.append(f"cache_dir: the embedded default's data and model under {config.cache_dir!r} are made by "
                        f"`python -m hybridrl.defaults.assets` (or the first `python -m hybridrl.main_ppo`)")


def compose_sft_config(overrides: Mapping[str, Any] | None = None) -> SFTConfig:
    """The validated config for `overrides` ({"dotted.key": value}) on top of sft_trainer.yaml, without Hydra.

    sft_trainer.yaml has no defaults list, so loading it with OmegaConf is what Hydra composes; going
    without Hydra lets code that already runs inside a Hydra app (main_ppo preparing the embedded
    default) build this config too. Values are Python objects, so paths need no override quoting.
    """
    cfg = OmegaConf.load(os.path.join(CONFIG_DIR, "sft_trainer.yaml"))
    for key, value in (overrides or {}).items():
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return validate_sft_config(cfg)


# ---- launching ----

def run_sft(config: SFTConfig) -> str:
    """Train on every rank; returns the directory of the saved HF model (same on every rank)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from hybridrl.trainer.sft_trainer import run_sft_rank
    from hybridrl.utils.tokenizer import load_tokenizer

    # Resolved once here and handed to every rank (pickled with the launch's arguments), as the PPO controller does.
    tokenizer = load_tokenizer(config.model.partial_pretrain, trust_remote_code=config.model.trust_remote_code)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: this process is one rank
        world_size = int(os.environ["WORLD_SIZE"])
        expected = config.trainer.nnodes * config.trainer.n_gpus_per_node
        if world_size != expected:
            raise ConfigError([f"trainer.n_gpus_per_node: torchrun started {world_size} ranks, the config says "
                               f"{expected} (trainer.nnodes x trainer.n_gpus_per_node)"])
        return run_sft_rank(config, tokenizer)
    if config.trainer.nnodes != 1:
        raise ConfigError([f"trainer.nnodes: expected 1 when main_sft starts the ranks itself, got "
                           f"{config.trainer.nnodes}; for several nodes start it with torchrun on each node"])
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    with launcher_scratch_dir() as scratch:
        launch = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=config.trainer.n_gpus_per_node,
            run_id=f"hybridrl-sft-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d", rdzv_endpoint="localhost:0",
            max_restarts=0, monitor_interval=0.2, start_method="spawn", logs_specs=DefaultLogsSpecs(log_dir=scratch))
        results = elastic_launch(launch, run_sft_rank)(config, tokenizer)
    return results[0]


@contextlib.contextmanager
def launcher_scratch_dir():
    """A folder for what torch's launcher writes and never removes: its log folder (a new /tmp/torchelastic_* a
    launch otherwise) and each failed rank's pickled traceback (/tmp/pytorch-errorfile-*.pickle, made in this
    process's temp folder). Removed after the launch: a rank's error is in the raised ChildFailedError by then."""
    scratch = tempfile.mkdtemp(prefix="hybridrl-sft-launch-")
    temp_folder = tempfile.tempdir
    tempfile.tempdir = scratch  # read by torch.multiprocessing.start_processes for the traceback files
    try:
        yield scratch
    finally:
        tempfile.tempdir = temp_folder
        shutil.rmtree(scratch, ignore_errors=True)


@hydra.main(config_path="../config", config_name="sft_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    try:
        config = validate_sft_config(cfg)
    except ConfigError as err:
        exit_with_config_errors(err.problems)
    model_dir = run_sft(config)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank gets here
        print(f"[hybridrl] SFT model saved to {model_dir}")



def cli() -> None:
    run_hydra_cli(main, config_name="sft_trainer")


if __name__ == "__main__":
    cli()
