"""Compose the config with Hydra's compose API: what `python -m hybridrl.main_ppo ...` builds, as a function.

Used by tests and by code that starts a job without a command line. `config_dir` may hold a user's
own YAML whose defaults list `ppo_trainer` (see hybridrl/main_ppo.py for that YAML).
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


def compose_config(overrides: Sequence[str] = (), config_name: str = "ppo_trainer",
                   config_dir: str | None = None) -> DictConfig:
    """The composed (unvalidated) config for `overrides`, e.g. ["algorithm=gae", "data.train_batch_size=8"]."""
    with initialize_config_dir(config_dir=os.path.abspath(config_dir or CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


# A path element of an override's value that starts with `~`: the whole value, or an entry of a [list].
_HOME_PATH = re.compile(r"(^|[\[,]\s*)(~[^,\[\]'\"\s]*)")


def quote_home_paths(overrides: Sequence[str]) -> list[str]:
    """The command line's overrides with each `~/...` value quoted for Hydra: `data.train_files=~/d/t.parquet`
    becomes `data.train_files='~/d/t.parquet'`. bash expands `~` only at the start of a word or after the `=` of a
    shell variable assignment, and `data.train_files=` is neither, so Hydra receives the `~`, which its override
    grammar refuses unquoted (a lexer error). Quoted, it is the string validation expands (PATH_KEYS). A leading `~`
    of the override itself (Hydra's delete, `~key`), flags and values the user quoted are left alone."""
    quoted = []
    for override in overrides:
        key, equals, value = override.partition("=")
        if override.startswith("-") or not equals or "'" in value or '"' in value:
            quoted.append(override)
        else:
            quoted.append(key + equals + _HOME_PATH.sub(r"\1'\2'", value))
    return quoted
