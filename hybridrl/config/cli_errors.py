"""One line for each of Hydra's composition errors, in validate_config's `<key>: expected ..., got ...` form, and
one `run error:` line for an error after the start.

Hydra reports a bad command line over several lines (plus its config search path); the entry point
prints this one line instead, so a bad override reads like any other config problem. An error after the start
(in the driver, or raised by the TaskRunner or a worker and handed up by Ray) is printed as its cause first, one
line, then its traceback once (the worker's own, not the driver's Hydra and ray.get frames), exit code 1.
"""
from __future__ import annotations

import difflib
import os
import re
import sys
import traceback

from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from hybridrl.config.compose import CONFIG_DIR, compose_config, is_append, override_defined_keys, quote_home_paths


def describe_hydra_error(err: HydraException, argv: list[str]) -> str:
    """One line naming the key (or override) Hydra rejected and what it expected instead."""
    if isinstance(err, OverrideParseException):
        return _unparsable_override(err, argv)
    if isinstance(err, MissingConfigException) and err.options:
        return _unknown_group_choice(err)
    if "Could not load 'ppo_trainer'" in str(err):
        return (f"{_one_line(str(err))} Hydra looks for ppo_trainer in --config-path only: add "
                "`hydra: {searchpath: [pkg://hybridrl.config]}` to your YAML, or pass --config-dir instead "
                "(see hybridrl/main_ppo.py)")
    unknown = re.match(r"Could not override '([^']+)'", str(err))
    if unknown and isinstance(err.__cause__, (ConfigKeyError, ConfigAttributeError)):
        return _unknown_key(unknown.group(1), err.__cause__.full_key, argv)
    return _prefixed_by_key(_one_line(str(err)), argv)


def _unparsable_override(err: OverrideParseException, argv: list[str]) -> str:
    parser = OverridesParser.create()
    for override in _overrides(argv):
        try:
            parser.parse_override(override)
        except HydraException:
            key = override.split("=", 1)[0].lstrip("+~")
            return (f"{key}: expected an override in Hydra's syntax (key=value), got {override!r} "
                    f"({_one_line(str(err))})")
    return _one_line(str(err))


def _unknown_group_choice(err: MissingConfigException) -> str:
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", str(err))
    if missing is None:
        return _one_line(str(err))
    group, choice = missing.groups()
    return f"{group}: expected one of {', '.join(err.options)}, got {choice!r}"


def _unknown_key(override_key: str, missing_key: str, argv: list[str]) -> str:
    override = next((o for o in _overrides(argv) if o.split("=", 1)[0] == override_key), override_key)
    hint = _did_you_mean(missing_key)
    return (f"{override_key}: expected a key of the config, got unknown key {missing_key!r}{hint}; "
            f"to add a new key write +{override}")


def _did_you_mean(missing_key: str) -> str:
    """A close known key from hybridrl's own config (a user's YAML extends it, so its keys are the ones to match)."""
    from hybridrl.config.compose import compose_config

    GlobalHydra.instance().clear()  # the failed run left Hydra initialised
    parent_path, _, key = missing_key.rpartition(".")
    parent = OmegaConf.select(compose_config(), parent_path) if parent_path else compose_config()
    if not isinstance(parent, DictConfig):
        return ""
    close = difflib.get_close_matches(key, [str(k) for k in parent.keys()], n=1, cutoff=0.6)
    return f" (did you mean {parent_path + '.' if parent_path else ''}{close[0]}?)" if close else ""


def _prefixed_by_key(message: str, argv: list[str]) -> str:
    """`<key>: message` when the message quotes the key of one of the overrides, else the message."""
    keys = {override.split("=", 1)[0].lstrip("+~") for override in _overrides(argv)}
    quoted = [key for key in re.findall(r"'([^']+)'", message) if key in keys]
    return f"{quoted[0]}: {message}" if quoted else message


def _override_defined_keys(argv: list[str], config_name: str) -> list[str]:
    """The command line with override_defined_keys applied to its overrides, judged against the config it names
    (--config-name, --config-dir or an absolute --config-path) composed with its other overrides. A config that
    does not compose leaves the command line as it is, for Hydra to report."""
    args = get_args_parser().parse_args(argv)
    config_dir = args.config_dir or (args.config_path if args.config_path and os.path.isabs(args.config_path)
                                     else CONFIG_DIR)
    others = [override for override in args.overrides
              if not is_append(override) and not override.lstrip("~").startswith(("hydra.", "hydra/"))]
    try:
        config = compose_config(others, args.config_name or config_name, config_dir)
    except HydraException:
        return argv
    rewritten = dict(zip(args.overrides, override_defined_keys(args.overrides, config)))
    return [rewritten.get(arg, arg) for arg in argv]


def _overrides(argv: list[str]) -> list[str]:
    """The overrides on the command line, split by Hydra's own argument parser (flags and their values left out)."""
    try:
        return list(get_args_parser().parse_args(argv).overrides)
    except SystemExit:  # argparse rejected the flags themselves; Hydra already said so
        return []


def _one_line(message: str) -> str:
    """Hydra's message without its config search path and doc links, joined into one line."""
    message = message.split("Config search path:")[0]
    lines = [line.strip() for line in message.splitlines()]
    return " ".join(line for line in lines if line and not line.startswith("See https://"))


CONFIG_ERROR_EXIT_CODE = 2
RUN_ERROR_EXIT_CODE = 1


def exit_with_config_errors(problems: list[str]) -> None:
    for problem in problems:
        print(f"config error: {problem}", file=sys.stderr)
    sys.exit(CONFIG_ERROR_EXIT_CODE)


def exit_with_run_error(error: Exception) -> None:
    print(describe_run_error(error), file=sys.stderr, flush=True)
    sys.exit(RUN_ERROR_EXIT_CODE)


def describe_run_error(error: Exception) -> str:
    """`run error: <type>: <message>` of the exception where it was raised, then the traceback of where it was raised.

    Ray re-raises a remote exception as a RayTaskError whose `cause` is the exception itself (a RayTaskError again
    when the TaskRunner re-raised a worker's) and whose text is the remote process's name and its stack, the
    cause's chained tracebacks included. The driver's own stack (Hydra, ray.get) says nothing about the cause and
    is left out."""
    from ray.exceptions import RayTaskError  # the driver has imported Ray once a run started

    cause = error
    while isinstance(cause, RayTaskError) and isinstance(cause.cause, BaseException):
        cause = cause.cause
    message = " ".join(line.strip() for line in str(cause).splitlines() if line.strip())
    headline = f"run error: {type(cause).__name__}: {message}" if message else f"run error: {type(cause).__name__}"
    if isinstance(error, RayTaskError):
        return f"{headline}\n{str(error).rstrip()}"
    return f"{headline}\n{''.join(traceback.format_exception(error)).rstrip()}"


def run_hydra_cli(main, config_name: str = "ppo_trainer") -> None:
    """Run a `@hydra.main` function (whose config is `config_name` of hybridrl/config unless the command line names
    another), turning Hydra's multi-line composition errors (bad override, unknown key, unknown group choice) into
    one `config error:` line. HYDRA_FULL_ERROR=1 set by the user keeps Hydra's own report. The job reports its own
    errors (`exit_with_config_errors`, `exit_with_run_error`). The command line is prepared for Hydra first: a `~/...`
    value is quoted (compose.quote_home_paths), so the README's `data.train_files=~/data/...` parses, and a
    `+key=value` on a key the config defines becomes an override (compose.override_defined_keys), as verl's scripts
    write keys verl's YAML lacks."""
    sys.argv[1:] = quote_home_paths(sys.argv[1:])
    if any(is_append(override) for override in _overrides(sys.argv[1:])):
        sys.argv[1:] = _override_defined_keys(sys.argv[1:], config_name)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"  # makes Hydra raise instead of printing its report and exiting
    try:
        main()
    except HydraException as err:
        exit_with_config_errors([describe_hydra_error(err, sys.argv[1:])])
