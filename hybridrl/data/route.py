"""Which route a run's steps take, as config settings: one rule, read by the config checks and the trainer alike.

Every step gets its batch from the sample-group flow (trainer/ppo/group_rollout.py). Two choices shape it:
- its features (data_flow_switch): the sample buffer, dynamic sampling, over-sampling and partial rollout act only
  when data_flow.enable, verl's algorithm.filter_groups.enable or an asynchronous schedule turns them on;
- its generate function (engine_servers_switch): agent loops on the ranks' engine servers, or one batched call of
  the colocated engines (hf, sglang, vllm in-process) per batch of groups, the fastest where nothing needs a server.
"""
from __future__ import annotations


def data_flow_switch(enable: bool, filter_groups: bool, schedule: str) -> str | None:
    """What turns the data flow's features on, as a config setting (None: off, every group is trained as generated):
    data_flow.enable, verl's algorithm.filter_groups.enable, or an asynchronous schedule (async_training.mode
    one_step_off or fully_async), which streams groups through the buffer."""
    if enable:
        return "data_flow.enable=true"
    if filter_groups:
        return "algorithm.filter_groups.enable=true"
    return None if schedule == "sync" else f"async_training.mode={schedule!r}"


def engine_servers_switch(rollout_mode: str, custom_generate_function: str | None) -> str | None:
    """What makes the flow generate through agent loops on the ranks' engine servers, as a config setting (None: one
    batched engine call per batch of groups): rollout.mode=async (which every rollout pool of its own and every
    asynchronous schedule runs in: trainer/config_checks.py), or data_flow.custom_generate_function, which is handed
    the servers (agent_loop/sample_generate.py)."""
    if rollout_mode == "async":
        return "actor_rollout_ref.rollout.mode='async'"
    if custom_generate_function is not None:
        return "data_flow.custom_generate_function (it is handed the engine servers)"
    return None
