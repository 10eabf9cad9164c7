"""Function hooks of the data flow: a `path` + `name` pair in config names a Python function (as verl's
custom_reward_function does); `path: null` with a `name` picks a built-in from hybridrl/data/filters.py.

Each hook's contract (checked at config validation, before Ray starts: the file must load, define the name, be a
function of the right kind taking the listed positional parameters; errors name the key):

    data_flow.rollout_function          def f(rollout, step, prompt_source, evaluation) -> list[list[Sample]]
        the whole rollout of a step: `rollout` (trainer/ppo/group_rollout.GroupRollout) runs groups on the engine
        servers and scores them, `prompt_source` (data/prompt_source.PromptSource) hands out groups and takes
        unfinished ones back. Returns data.train_batch_size scored groups (fewer: see insufficient_groups). With
        ReMax (algorithm.adv_estimator=remax) each group of the prompt source ends with its greedy baseline
        (Sample.is_baseline; data/sample.py sampled / baseline_of): return the groups with it, scored (a group
        without one fails the step naming this key); rollout.keep judges the sampled responses only.
    data_flow.eval_function             same signature, called with evaluation=True and the validation prompts (and
        each eval set's: rollout.submit(group, evaluation=True) draws with its sampling); returns scored groups,
        logged as validation's metrics (val-core/<data_source>/reward/mean@n, ...).
    data_flow.custom_generate_function  async def f(ctx, sample, sampling_params) -> Sample
        one sample in, one out, run in an agent-loop worker: ctx.server_manager.generate(...), ctx.tokenizer,
        ctx.config, ctx.response_length. Record generated tokens with the version the engine reported for them,
        sample.append(output.token_ids, output.log_probs, output.weight_version). Continue from sample.tokens when
        sample.status == "aborted". A ReMax baseline (sample.is_baseline) comes with greedy sampling_params:
        generate it with them.
    data_flow.dynamic_sampling_filter   def f(config, group) -> bool (keep the group); this filter and the two below
        get a group's sampled responses only (with ReMax, the group without its baseline)
    data_flow.over_sampling_filter      def f(config, groups) -> list[list[Sample]] (ordered; the first
        data.train_batch_size are trained on)
    data_flow.buffer_filter             def f(config, step, buffer, num_groups) -> list[list[Sample]] (the groups
        to take out of the buffer, at most num_groups)
    data_flow.reward_function           [async] def f(config, sample) -> float | dict, or with
        data_flow.group_reward=true [async] def f(config, group) -> list[float | dict] (with ReMax the group's
        baseline is among them, last, is_baseline: scored on the same scale as its samples)
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hybridrl.utils.import_utils import load_extern_object

BUILTINS_MODULE = "hybridrl.data.filters"


@dataclass(frozen=True)
class HookSpec:
    """What a hook must be: its positional parameters' count and whether it must (or may) be a coroutine."""
    num_args: int
    must_be_async: bool = False
    may_be_async: bool = False
    signature: str = ""


HOOKS: dict[str, HookSpec] = {
    "rollout_function": HookSpec(4, signature="def f(rollout, step, prompt_source, evaluation)"),
    "eval_function": HookSpec(4, signature="def f(rollout, step, prompt_source, evaluation)"),
    "custom_generate_function": HookSpec(3, must_be_async=True, signature="async def f(ctx, sample, "
                                                                           "sampling_params)"),
    "dynamic_sampling_filter": HookSpec(2, signature="def f(config, group)"),
    "over_sampling_filter": HookSpec(2, signature="def f(config, groups)"),
    "buffer_filter": HookSpec(4, signature="def f(config, step, buffer, num_groups)"),
    "reward_function": HookSpec(2, may_be_async=True, signature="[async] def f(config, sample_or_group)"),
}


class HookError(ValueError):
    """A hook that cannot be used; the message names its config key."""


def load_hook(hook: str, spec_config, prefix: str = "data_flow") -> Optional[Callable]:
    """The function `<prefix>.<hook>.path/name` names, checked against its contract; None when both are null."""
    key = f"{prefix}.{hook}"
    path, name = spec_config.get("path"), spec_config.get("name")
    if path is None and name is None:
        return None
    if name is None:
        raise HookError(f"{key}.name: expected the function's name in {path!r}, got None")
    if path is None:
        function = getattr(importlib.import_module(BUILTINS_MODULE), name, None)
        if name not in builtin_names():
            raise HookError(f"{key}.name: expected a built-in ({', '.join(builtin_names())}) when {key}.path is "
                            f"null, got {name!r}")
    else:
        try:
            function = load_extern_object(path, name)
        except Exception as err:  # a missing file, a name it lacks, the file itself raising on import
            raise HookError(f"{key}: cannot load {name!r} from {path!r}: {type(err).__name__}: {err}") from err
    check_signature(hook, key, function)
    return function


def check_signature(hook: str, key: str, function: Any) -> None:
    spec = HOOKS[hook]
    if not callable(function) or inspect.isclass(function):
        raise HookError(f"{key}: expected a function `{spec.signature}`, got {function!r}")
    is_async = inspect.iscoroutinefunction(function)
    if spec.must_be_async and not is_async:
        raise HookError(f"{key}: expected an async function `{spec.signature}`, got a plain function "
                        f"{function.__name__}")
    if is_async and not (spec.must_be_async or spec.may_be_async):
        raise HookError(f"{key}: expected a plain (not async) function `{spec.signature}`, got async "
                        f"{function.__name__}")
    try:
        inspect.signature(function).bind(*range(spec.num_args))
    except TypeError as err:
        raise HookError(f"{key}: expected `{spec.signature}` ({spec.num_args} positional parameters), "
                        f"{function.__name__}{inspect.signature(function)} does not take them: {err}") from err


def builtin_names() -> list[str]:
    module = importlib.import_module(BUILTINS_MODULE)
    return sorted(getattr(module, "__all__"))


def load_all_hooks(data_flow_config) -> dict[str, Optional[Callable]]:
    """Every hook of the data_flow section, by name (None: not set)."""
    return {hook: load_hook(hook, data_flow_config.get(hook)) for hook in HOOKS}
