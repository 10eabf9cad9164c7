"""Config checks of the reward: the reward manager and what it is built with, the reward hub's named scorers and
remote reward model, and before the start the user's reward function and the ground-truth column the managers read,
registered with hybridrl.config.checks. They run before Ray starts; load_reward_manager relies on them."""
from __future__ import annotations

import importlib.util
import inspect
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hybridrl.config.checks import Values, expect_file, register_check, register_registry, run_rule
from hybridrl.config.schema import PPOConfig
from hybridrl.data.config_checks import eval_set_files, files_read
from hybridrl.utils.import_utils import NameNotDefined, load_extern_object


def _reward_manager(name: str) -> Any:
    from hybridrl.reward.managers import get_reward_manager_cls

    return get_reward_manager_cls(name)


register_registry("reward_model.reward_manager", _reward_manager)


@register_check()
def _reward_hub_settings(values: Values, problems: list[str]) -> None:
    """custom_reward_function.rm_type names a hub scorer (not together with a path); remote_rm has an http(s)
    url, and its worst case (every attempt timing out) fits in reward_model.score_timeout."""
    from hybridrl.reward.hub import check_rm_type

    rm_type, path = values("custom_reward_function.rm_type"), values("custom_reward_function.path")
    remote_url = values("custom_reward_function.remote_rm.url")
    if rm_type is not None:
        try:
            check_rm_type(rm_type)
        except ValueError as err:
            problems.append(f"custom_reward_function.rm_type: expected a reward-hub scorer, got {rm_type!r} ({err})")
        if path is not None:
            problems.append(f"custom_reward_function.rm_type: expected null with custom_reward_function.path set "
                            f"(one scorer for the run: the user's function or a named one), got {rm_type!r}")
        if rm_type.removeprefix("boxed_") == "remote_rm" and not remote_url:
            problems.append("custom_reward_function.remote_rm.url: expected the reward server's http(s) URL with "
                            "custom_reward_function.rm_type=remote_rm, got None")
        if rm_type.removeprefix("boxed_") == "math_verify" and importlib.util.find_spec("math_verify") is None:
            problems.append("custom_reward_function.rm_type: expected a scorer whose package is installed, got "
                            "'math_verify' (pip install math-verify, or pip install -e '.[math]')")
    if remote_url:
        if not remote_url.startswith(("http://", "https://")):
            problems.append(f"custom_reward_function.remote_rm.url: expected an http:// or https:// URL, got "
                            f"{remote_url!r}")
        run_rule(_remote_rm_fits_in_score_timeout, values, problems)


def _remote_rm_fits_in_score_timeout(values: Values, problems: list[str]) -> None:
    from hybridrl.reward.remote_rm import RemoteRewardModel

    key = "custom_reward_function.remote_rm"
    score_timeout = values("reward_model.score_timeout")
    timeout = values(f"{key}.timeout")
    worst = RemoteRewardModel(url=values(f"{key}.url"), timeout=timeout, max_retries=values(f"{key}.max_retries"),
                              retry_delay=values(f"{key}.retry_delay"), max_concurrency=1).worst_case_seconds()
    if score_timeout is not None and worst >= score_timeout:
        problems.append(f"{key}.timeout: expected timeout * (max_retries + 1) plus the retry delays = {worst:g} s "
                        f"below reward_model.score_timeout={score_timeout:g} (else a slow server fails the run "
                        f"instead of costing its samples), got {timeout:g}")


@register_check()
def _custom_function_named(values: Values, problems: list[str]) -> None:
    path, name = values("custom_reward_function.path"), values("custom_reward_function.name")
    if path is not None and not name:
        problems.append(f"custom_reward_function.name: expected the name of a function in custom_reward_function.path "
                        f"= {path!r}, got {name!r}")


@register_check()
def _reward_manager_settings(values: Values, problems: list[str]) -> None:
    """load_reward_manager builds the manager with what it takes: an overlong penalty needs a manager that applies
    one (its constructor takes overlong_buffer_cfg, as dapo's) and a buffer within the response budget."""
    from hybridrl.reward.managers import get_reward_manager_cls

    name = values("reward_model.reward_manager")
    try:
        manager_cls = get_reward_manager_cls(name)
    except (ValueError, KeyError):  # an unregistered name: validation's registry step reports it
        return
    if values("reward_model.overlong_buffer.enable"):
        buffer_len, budget = values("reward_model.overlong_buffer.len"), values("data.max_response_length")
        if "overlong_buffer_cfg" not in inspect.signature(manager_cls).parameters:
            problems.append(f"reward_model.overlong_buffer.enable: expected false with reward_model.reward_manager="
                            f"{name!r} (it does not apply an overlong penalty; use reward_model.reward_manager=dapo), "
                            f"got True")
        elif not 0 < buffer_len <= budget:
            problems.append(f"reward_model.overlong_buffer.len: expected 1 to data.max_response_length = {budget} "
                            f"with reward_model.overlong_buffer.enable=true, got {buffer_len}")


@register_check()
def _reward_kwargs_fit_the_manager(values: Values, problems: list[str]) -> None:
    """reward_model.reward_kwargs are keyword arguments the manager's constructor takes (verl passes them so), not
    the ones the loader passes itself; where one stands for a config key (max_resp_len: data.max_response_length;
    overlong_buffer_cfg: reward_model.overlong_buffer, copied there by validation.ALIASES) it holds that key's value.
    Checked here, so a typo fails before Ray starts rather than in the manager's constructor."""
    from hybridrl.reward.managers import get_reward_manager_cls
    from hybridrl.reward.managers.loader import CONFIG_ARGUMENTS, LOADER_ARGUMENTS

    name, reward_kwargs = values("reward_model.reward_manager"), values("reward_model.reward_kwargs")
    try:
        parameters = inspect.signature(get_reward_manager_cls(name)).parameters
    except (ValueError, KeyError):  # an unregistered name: validation's registry step reports it
        return
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    accepted = [key for key in parameters if key not in LOADER_ARGUMENTS and parameters[key].kind in
                (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    for kwarg, value in reward_kwargs.items():
        key = f"reward_model.reward_kwargs.{kwarg}"
        if kwarg in LOADER_ARGUMENTS or not (kwarg in accepted or takes_any):
            takes = f"one of {', '.join(accepted)}" if accepted else "it takes none"
            problems.append(f"{key}: expected a keyword argument of reward manager {name!r} ({takes}; "
                            f"{', '.join(LOADER_ARGUMENTS)} come from the loader), got {kwarg!r}")
        elif kwarg == "max_resp_len" and value != values(CONFIG_ARGUMENTS[kwarg]):
            problems.append(f"{key}: expected the value of {CONFIG_ARGUMENTS[kwarg]} = "
                            f"{values(CONFIG_ARGUMENTS[kwarg])} (the penalty's budget is the response budget), "
                            f"got {value!r}")
        elif kwarg == "overlong_buffer_cfg" and not _is_overlong_buffer(value, values(CONFIG_ARGUMENTS[kwarg])):
            problems.append(f"{key}: expected a dict of keys of {CONFIG_ARGUMENTS[kwarg]} "
                            f"({', '.join(values(CONFIG_ARGUMENTS[kwarg]))}), got {value!r}")


def _is_overlong_buffer(value: Any, overlong_buffer: dict) -> bool:
    return isinstance(value, dict) and set(value) <= set(overlong_buffer)


@register_check("warnings")
def _score_timeout_not_watched(config: PPOConfig) -> list[str]:
    """A manager not derived from RewardManagerBase (a verl AbstractRewardManager subclass, ported as it is) scores in
    its own __call__, where base.py cannot watch a scorer, so reward_model.score_timeout does not apply to it. It runs
    as verl runs it (verl has no such timeout), and the start says so, rather than asking a verl user for a key."""
    from hybridrl.reward.managers import RewardManagerBase, get_reward_manager_cls

    name, score_timeout = config.reward_model.reward_manager, config.reward_model.score_timeout
    manager_cls = get_reward_manager_cls(name)
    if score_timeout is None or (isinstance(manager_cls, type) and issubclass(manager_cls, RewardManagerBase)):
        return []
    return [f"reward_model.score_timeout={score_timeout:g} does not apply to reward_model.reward_manager={name!r}: "
            f"{getattr(manager_cls, '__name__', manager_cls)} scores in its own __call__, not through hybridrl's "
            f"RewardManagerBase, which watches each scorer call; a hung scorer stalls the step (set "
            f"reward_model.score_timeout=null to say it is meant)"]


@register_check("paths")
def _reward_file_exists(config: PPOConfig, problems: list[str]) -> None:
    if config.custom_reward_function.path is not None:
        expect_file("custom_reward_function.path", config.custom_reward_function.path, ".py", problems)


@register_check("preflight")
def _check_reward_function(config: PPOConfig, problems: list[str]) -> None:
    """Run the user's reward file here, as the reward manager will, and look the function up by name."""
    path, name = config.custom_reward_function.path, config.custom_reward_function.name
    if path is None or not os.path.isfile(path):  # unset, or reported by _reward_file_exists
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


@register_check("preflight")
def _check_ground_truth_column(config: PPOConfig, problems: list[str]) -> None:
    """Every data file the run reads has the column 'reward_model' with a ground_truth, when the reward manager
    reads it. With data.custom_cls the class decides the columns; an unreadable file is data's problem."""
    manager = config.reward_model.reward_manager
    if config.data.custom_cls.path or not _reads_ground_truth(manager):
        return
    for where, path in files_read(config):
        try:
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError):  # data/config_checks.py reports it
            continue
        if "reward_model" not in schema.names:
            problems.append(f"{where}: expected a column 'reward_model' (its ground_truth is read by "
                            f"reward_model.reward_manager={manager!r}), got {path!r} with columns {schema.names}")
        elif not _has_ground_truth(schema.field("reward_model").type):
            problems.append(f"{where}: expected column 'reward_model' to be a struct with a 'ground_truth' field, got "
                            f"type {schema.field('reward_model').type} in {path!r}")


@register_check("preflight")
def _check_data_sources_scored(config: PPOConfig, problems: list[str]) -> None:
    """Every row's data_source has a registered scorer, when the reward manager picks the scorer by it
    (default_compute_score): not with custom_reward_function.path or rm_type, or data_flow.reward_function, which
    score every sample, nor with a manager of the user's. A reward model does not exempt the rows: its scores are
    added to the rule scores. Without this, an unknown source failed at the first step's scoring."""
    from hybridrl.data.row_checks import rows_by_data_source, rows_named

    custom = config.custom_reward_function
    if custom.path or custom.rm_type or config.data_flow.reward_function.name or config.data.custom_cls.path \
            or not _reads_ground_truth(config.reward_model.reward_manager):
        return
    source_key = config.data.reward_fn_key
    for where, path in files_read(config) + eval_set_files(config):
        try:
            unscored = rows_by_data_source(path, source_key, lambda source: not _has_scorer(source))
        except (pa.ArrowException, OSError, KeyError):  # the file or its column: data/config_checks.py reports it
            continue
        for source, rows in unscored.items():
            problems.append(f"{where}: expected a data_source ({source_key}, data.reward_fn_key) with a "
                            f"registered scorer (hybridrl.reward.scorers.register_scorer), or "
                            f"custom_reward_function.path / rm_type to score every sample, got {source!r} in "
                            f"{rows_named(path, rows)}")


def _has_scorer(source) -> bool:
    from hybridrl.reward.scorers import get_scorer

    if not isinstance(source, str):  # a null data_source
        return False
    try:
        get_scorer(source)
    except NotImplementedError:
        return False
    return True


def _reads_ground_truth(manager_name: str) -> bool:
    """Every manager built on RewardManagerBase (naive, batch, dapo) reads reward_model.ground_truth."""
    from hybridrl.reward.managers import RewardManagerBase, get_reward_manager_cls

    return issubclass(get_reward_manager_cls(manager_name), RewardManagerBase)


def _has_ground_truth(column_type: pa.DataType) -> bool:
    """A struct with the field, or a map (whose keys the footer does not tell)."""
    if pa.types.is_map(column_type):
        return True
    return pa.types.is_struct(column_type) and "ground_truth" in {field.name for field in column_type}
