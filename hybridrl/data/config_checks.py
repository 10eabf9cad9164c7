"""Config checks of the data: the data flow (what turns it on: route.data_flow_switch) and its hooks, and before the start
the data files (they exist, are readable parquet with rows and the columns the dataset reads, and hold one training
batch) and every row of them (row_checks.py: messages, lengths), registered with hybridrl.config.checks. The
validation files and eval sets are not opened when the run never validates."""
from __future__ import annotations

import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hybridrl.config.checks import Values, expect_file, register_check
from hybridrl.config.schema import PPOConfig
from hybridrl.data.route import data_flow_switch


# data_flow keys that do something only when the data flow is on, with their off values.
DATA_FLOW_DEFAULTS: dict[str, Any] = {
    "over_sampling_batch_size": None, "max_num_gen_batches": 0, "insufficient_groups": "fail",
    "partial_rollout": False, "mask_offpolicy_in_partial_rollout": False, "group_reward": False, "reward_key": None,
}


# with a reward model, one_step_off scores each batch when its step takes it: these need the scores earlier
SCORE_WHILE_GENERATING = {
    "data_flow.dynamic_sampling_filter": "judges each group by its score as it finishes",
    "data_flow.over_sampling_filter": "orders the finished groups, by their scores",
    "data_flow.rollout_function": "scores groups as it makes them (rollout.score_group)",
}


@register_check()
def _data_flow_settings(values: Values, problems: list[str]) -> None:
    """data_flow (slime's) and algorithm.filter_groups (verl's DAPO form of it): in any rollout.mode, schedule and
    engine (every step's groups pass through it: data/route.py), its hooks importable with the right signatures
    (hybridrl/data/hooks.py), its keys unused while it is off refused."""
    from hybridrl.data.hooks import HOOKS, HookError, load_hook

    flow = values("data_flow")
    filter_groups = values("algorithm.filter_groups")
    schedule = values("async_training.mode")
    switch = data_flow_switch(flow["enable"], filter_groups["enable"], schedule)
    if switch is None:
        for key, default in DATA_FLOW_DEFAULTS.items():
            if flow[key] != default:
                problems.append(f"data_flow.{key}: expected {default!r} with data_flow.enable=false (it acts only in "
                                f"the data flow; set data_flow.enable=true), got {flow[key]!r}")
        for hook in HOOKS:
            if flow[hook].get("path") is not None or flow[hook].get("name") is not None:
                problems.append(f"data_flow.{hook}: expected null path and name with data_flow.enable=false (set "
                                f"data_flow.enable=true), got {flow[hook]!r}")
        return
    if schedule == "fully_async":
        _fully_async_stream_settings(flow, problems)
    if schedule == "one_step_off" and values("reward_model.enable") and flow["reward_function"].get("name") is None:
        _reward_model_one_step_off(flow, filter_groups["enable"], problems)
    if filter_groups["enable"] and flow["max_num_gen_batches"] not in (0, filter_groups["max_num_gen_batches"]):
        problems.append(f"data_flow.max_num_gen_batches: expected 0 or algorithm.filter_groups.max_num_gen_batches = "
                        f"{filter_groups['max_num_gen_batches']} (the same cap), got {flow['max_num_gen_batches']!r}")
    train_batch = values("data.train_batch_size")
    over = flow["over_sampling_batch_size"]
    if flow["over_sampling_filter"].get("name") is not None and (over or train_batch) < train_batch + 1:
        problems.append(f"data_flow.over_sampling_batch_size: expected more than data.train_batch_size = {train_batch} "
                        f"groups with data_flow.over_sampling_filter set (it orders them and keeps the first "
                        f"train_batch_size), got {over!r}")
    if flow["group_reward"] and flow["reward_function"].get("name") is None:
        problems.append("data_flow.group_reward: expected false without data_flow.reward_function (the reward "
                        "manager scores samples itself), got True")
    for hook in HOOKS:
        try:
            load_hook(hook, flow[hook])
        except HookError as err:
            problems.append(str(err))


def _reward_model_one_step_off(flow, filter_groups: bool, problems: list[str]) -> None:
    """one_step_off generates the next batch on a thread of its own while the trainer pool's ranks update; the
    reward model's forward runs on those ranks, so it scores each batch on the controller's main thread when the
    step takes it (the update's collectives and the reward model's could otherwise reach the ranks in different
    orders). What needs a group's score while it is generated cannot have it then."""
    needs = {key: why for key, why in SCORE_WHILE_GENERATING.items()
             if flow[key.split(".")[1]].get("name") is not None}
    if filter_groups:
        needs["algorithm.filter_groups.enable"] = "judges each group by its score as it finishes"
    if needs:
        uses = "; ".join(f"{key} {why}" for key, why in needs.items())
        problems.append(f"reward_model.enable: expected false with async_training.mode='one_step_off' and "
                        f"{', '.join(needs)} ({uses}, on the thread that generates ahead while the trainer pool's "
                        f"ranks update; the reward model runs on those ranks, so under one_step_off it scores a "
                        f"batch only when the step takes it, on the controller's main thread: use "
                        f"async_training.mode=fully_async or sync, or a data_flow.reward_function), got True")


def _fully_async_stream_settings(flow, problems: list[str]) -> None:
    """fully_async streams groups (trainer/ppo/group_stream.py): each step takes the first kept groups to finish, up
    to (max_staleness + 1) x data.train_batch_size in flight; there is no batch of groups to over-sample, order or
    make with a rollout function."""
    why = ("with async_training.mode=fully_async (groups stream: each step takes the first data.train_batch_size "
           "kept groups to finish, (max_staleness + 1) x train_batch_size in flight)")
    if flow["over_sampling_batch_size"] is not None:
        problems.append(f"data_flow.over_sampling_batch_size: expected null {why}, got "
                        f"{flow['over_sampling_batch_size']!r}")
    for hook in ("over_sampling_filter", "rollout_function"):
        if flow[hook].get("path") is not None or flow[hook].get("name") is not None:
            problems.append(f"data_flow.{hook}: expected null path and name {why}, got {flow[hook]!r}")


@register_check("paths")
def _data_files_exist(config: PPOConfig, problems: list[str]) -> None:
    for key, files in (("data.train_files", config.data.train_files), ("data.val_files", config.data.val_files)):
        for index, path in enumerate(files):
            expect_file(f"{key}[{index}]", path, ".parquet", problems)
    for index, entry in enumerate(config.data.eval_sets):
        files = eval_set_paths(entry)
        for file_index, path in enumerate(files):
            expect_file(f"data.eval_sets[{index}].path" + (f"[{file_index}]" if len(files) > 1 else ""), path,
                        ".parquet", problems)
    if config.data.custom_cls.path is not None:
        expect_file("data.custom_cls.path", config.data.custom_cls.path, ".py", problems)


@register_check("preflight")
def _check_data_files_of_the_run(config: PPOConfig, problems: list[str]) -> None:
    _check_data(config, problems)


@register_check("preflight")
def _check_rows_of_the_run(config: PPOConfig, problems: list[str]) -> None:
    problems += _row_report(config).problems


@register_check("warnings")
def _row_warnings(config: PPOConfig) -> list[str]:
    """What the rows lose without stopping the run (truncation, dropped rows, empty messages); the lengths come
    from row_checks' cache, written by the preflight moments before."""
    return _row_report(config).warnings


def _row_report(config: PPOConfig):
    """The rows of every file the run reads whose columns are usable (a file with a problem of its own is
    reported by _check_data_files); lengths only when the policy's tokenizer folder is usable."""
    from hybridrl.data.row_checks import check_rows
    from hybridrl.models.config_checks import checked_policy_tokenizer, max_position_embeddings

    files = [(where, path) for where, path in files_read(config) + eval_set_files(config) if _usable(path, config)]
    tokenizer = checked_policy_tokenizer(config) if files else None
    return check_rows(config, files, tokenizer, max_position_embeddings(config))


def _usable(path: str, config: PPOConfig) -> bool:
    if config.data.custom_cls.path:  # the user's class decides what a row holds
        return False
    problems: list[str] = []
    _check_data_files("", [path], config, problems)
    return not problems


def eval_set_paths(entry: dict) -> list[str]:
    """An eval set's files: its `path`, one file or a list."""
    return [entry["path"]] if isinstance(entry["path"], str) else entry["path"]


def eval_set_files(config: PPOConfig) -> list[tuple[str, str]]:
    """(data.eval_sets[i].path[j], path) of every existing eval-set file, when the run validates."""
    if not config.trainer.runs_validation():
        return []
    files = []
    for index, entry in enumerate(config.data.eval_sets):
        paths = eval_set_paths(entry)
        files += [(f"data.eval_sets[{index}].path" + (f"[{position}]" if len(paths) > 1 else ""), path)
                  for position, path in enumerate(paths) if os.path.isfile(path)]
    return files


def usable_train_rows(config: PPOConfig) -> int | None:
    """The training rows batches are drawn from (None when unknown), for the disk-space warning; it runs only when
    the preflight found no problem, so _check_data_files_of_the_run reported nothing here."""
    return _check_data(config, [])


def files_read(config: PPOConfig) -> list[tuple[str, str]]:
    """(key[index], path) of every existing data file the run reads: the validation files only when it validates."""
    keys = [("data.train_files", config.data.train_files)]
    if config.trainer.runs_validation():
        keys.append(("data.val_files", config.data.val_files))
    return [(f"{key}[{index}]", path) for key, paths in keys for index, path in enumerate(paths)
            if os.path.isfile(path)]


def _check_data(config: PPOConfig, problems: list[str]) -> int | None:
    """Check the data files the run reads; return the training rows batches are drawn from (None when unknown)."""
    data = config.data
    train_rows = _check_data_files("data.train_files", data.train_files, config, problems)
    if config.trainer.runs_validation():
        _check_data_files("data.val_files", data.val_files, config, problems)
        for index, entry in enumerate(data.eval_sets):
            _check_data_files(f"data.eval_sets[{index}].path", eval_set_paths(entry), config, problems)
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
        if not os.path.isfile(path):  # _data_files_exist reported it
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
    """The columns RLHFDataset and the reward manager read (data.prompt_key, data.reward_fn_key), present and of a
    usable type; the ground truth the reward managers read is reward/config_checks.py's to check."""
    prompt, source = config.data.prompt_key, config.data.reward_fn_key
    required = {prompt: "data.prompt_key", source: "data.reward_fn_key"}
    for column, why in required.items():
        if column not in schema.names:
            problems.append(f"{where}: expected a column {column!r} ({why}), got {path!r} with columns {schema.names}")
    if prompt in schema.names and not _is_chat(schema.field(prompt).type):
        problems.append(f"{where}: expected column {prompt!r} (data.prompt_key) to hold chat messages, a list of "
                        f"{{role, content}}, got type {schema.field(prompt).type} in {path!r}")


def _is_chat(column_type: pa.DataType) -> bool:
    if not (pa.types.is_list(column_type) or pa.types.is_large_list(column_type)):
        return False
    message = column_type.value_type
    return pa.types.is_struct(message) and {"role", "content"} <= {field.name for field in message}
