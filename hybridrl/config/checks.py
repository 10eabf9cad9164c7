"""The registry of config checks. Each subsystem keeps the rules about its keys beside its code, in its
`config_checks.py`, and registers them here; config runs them and imports no subsystem, so the layers below
config know nothing of it and a rule lives in one place.

Stages, each run by a driver in config, every problem one line `<full.key.path>: expected ..., got ...`:
  "config"     `rule(values, problems)`, rules across keys, run by `validate_config` on the checked tree before
               the typed config is built. `values("a.b")` reads a key; reading one that is missing or already
               reported wrong raises `Skip`, which ends that rule quietly (its problem is reported already).
  "paths"      `check(config, problems)` on the typed config: the files and directories it names exist
               (`check_paths`, after the embedded defaults are written).
  "preflight"  `check(config, problems)`: what the run reads and writes is usable (`check_before_start`).
  "warnings"   `check(config) -> list[str]`: what may fail later without stopping the run; run by
               `check_before_start` only when the preflight found no problem.
Names chosen from a registry (estimators, losses, rollouts, reward managers) register their lookup with
`register_registry`; validation checks them all in one step, after the extensions have registered theirs.

hybridrl/checks.py imports every subsystem's check module and then calls `all_registered()`; a driver that runs
before that raises RuntimeError instead of passing a config that no rule has seen.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from hybridrl.config.structure import INVALID

STAGES = ("config", "paths", "preflight", "warnings")

_CHECKS: dict[str, list[Callable]] = {stage: [] for stage in STAGES}

# Names chosen from a registry: key -> lookup that raises ValueError or KeyError for an unknown name, its message
# listing the registered ones. Filled by the subsystems that own the registries.
REGISTRIES: dict[str, Callable[[str], Any]] = {}

_complete = False


def register_check(stage: str = "config") -> Callable[[Callable], Callable]:
    """Decorator: run the function in `stage` (see the module docstring), after the ones registered before it."""
    if stage not in STAGES:
        raise ValueError(f"stage: expected one of {STAGES}, got {stage!r}")

    def register(check: Callable) -> Callable:
        _CHECKS[stage].append(check)
        return check

    return register


def register_registry(key: str, lookup: Callable[[str], Any]) -> None:
    """`key` names an entry of a registry: `lookup(name)` raises ValueError or KeyError when it is not one."""
    REGISTRIES[key] = lookup


def all_registered() -> None:
    """Called by hybridrl/checks.py once every subsystem's check module is imported."""
    global _complete
    _complete = True


def registered_checks(stage: str) -> list[Callable]:
    """The checks of `stage` in registration order; RuntimeError when the subsystems' checks are not imported."""
    if not _complete:
        raise RuntimeError("config checks: the subsystems' checks are not registered; import hybridrl.checks "
                           "(it imports every subsystem's config_checks module) before validating a config")
    return list(_CHECKS[stage])


class Skip(Exception):
    """A rule touched a value that is missing or already reported as wrong: the rule does not apply."""


class Values:
    """Dotted-path reads of the checked tree; reading an invalid value skips the rule that asked."""

    def __init__(self, tree: Any):
        self._tree = tree

    def __call__(self, path: str) -> Any:
        node = self._tree
        for key in path.split("."):
            if not isinstance(node, dict) or key not in node:
                raise Skip(path)
            node = node[key]
        if node is INVALID:
            raise Skip(path)
        return node


def run_rule(rule: Callable[[Values, list[str]], None], values: Values, problems: list[str]) -> None:
    """Run one rule; a value it needs being invalid ends it (see Skip) without ending the others."""
    try:
        rule(values, problems)
    except Skip:
        pass


def critic_enabled(values: Callable[[str], Any]) -> bool:
    """`critic.enable`, where null means: on exactly when the advantage estimator is GAE (it needs values)."""
    enable = values("critic.enable")
    return values("algorithm.adv_estimator") == "gae" if enable is None else enable


def expect_file(key: str, path: str, suffix: str, problems: list[str]) -> None:
    """`path` is an existing file ending in `suffix` (".parquet", ".py")."""
    if not os.path.isfile(path):
        problems.append(f"{key}: expected an existing {suffix} file, got {path!r} (no such file)")
    elif not path.endswith(suffix):
        problems.append(f"{key}: expected a {suffix} file, got {path!r}")


def expect_entries_build(key: str, path: str, build: Callable[[str], Any], what: str, problems: list[str]) -> None:
    """The YAML at `path` (tools, interactions) builds here, before the start, as each agent-loop worker will build
    it: `build(path)` raises naming the file and the entry, or a class's own __init__ raises anything."""
    try:
        build(path)
    except Exception as err:  # the registry names file and entry; a class's own __init__ can raise anything
        problems.append(f"{key}: expected {what} whose every entry builds, got {path!r}: {err}")
