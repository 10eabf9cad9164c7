"""Compose the config with Hydra's compose API: what `python -m hybridrl.main_ppo ...` builds, as a function.

Used by tests and by code that starts a job without a command line. `config_dir` may hold a user's
own YAML whose defaults list `ppo_trainer` (see hybridrl/main_ppo.py for that YAML).
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


def compose_config(overrides: Sequence[str] = (), config_name: str = "ppo_trainer",
                   config_dir: str | None = None) -> DictConfig:
    """The composed (unvalidated) config for `overrides`, e.g. ["algorithm=gae", "data.train_batch_size=8"].
    A `+key=value` on a key the config defines overrides it, as on the command line (override_defined_keys)."""
    if any(is_append(override) for override in overrides):
        defined = compose_config([override for override in overrides if not is_append(override)], config_name,
                                 config_dir)
        overrides = override_defined_keys(overrides, defined)
    with initialize_config_dir(config_dir=os.path.abspath(config_dir or CONFIG_DIR), version_base=None):
        return compose(config_name=config_name, overrides=list(overrides))


def override_defined_keys(overrides: Sequence[str], config: DictConfig) -> list[str]:
    """The overrides with each `+key=value` on a key `config` defines written `++key=value`, which Hydra takes as an
    override. verl's scripts add with `+` the keys verl's YAML lacks (`+reward_model.overlong_buffer.enable=True`);
    where ours has the key, Hydra would refuse the `+` ("Could not append to config"). A `+` on a new key stays an
    append, and so does one on a dict-valued key: every config group is one, and Hydra cannot force-add a group."""
    return ["+" + override if is_append(override) and _defines(config, override.partition("=")[0][1:]) else override
            for override in overrides]


_UNDEFINED = object()


def _defines(config: DictConfig, key: str) -> bool:
    """Whether `config` has `key` (dotted) holding a value or a list, not a dict."""
    node = OmegaConf.select(config, key, default=_UNDEFINED, throw_on_resolution_failure=False)
    return node is not _UNDEFINED and not isinstance(node, DictConfig)


def is_append(override: str) -> bool:
    """Whether `override` is a `+key=value` (Hydra's append, which override_defined_keys may rewrite)."""
    return override.startswith("+") and not override.startswith("++") and "=" in override


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
