"""Compose the config with Hydra's compose API: what `python -m hybridrl.main_ppo ...` builds, as a function.

Used by tests and by code that starts a job without a command line. `config_dir` may hold a user's
own YAML whose defaults list `ppo_trainer` (see hybridrl/main_ppo.py for that YAML).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


def compose_config(overrides: Sequence[str] = (), config_name: str = "ppo_trainer",
                   config_dir: str | None = None) -> DictConfig:
    """The composed (unvalidated) config for `overrides`, e.g. ["algorithm=gae", "data.train_batch_size=8"]."""
    with initialize_config_dir(config_dir=os.path.abspath(config_dir or CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))
