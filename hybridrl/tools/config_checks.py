"""Config check of the tools, registered with hybridrl.config.checks: before the start, the tools of
multi_turn.tool_config_path build here as each agent-loop worker will build them, so a missing class or an invalid
schema is refused now, naming the file and the entry (the registry's message)."""
from __future__ import annotations

from hybridrl.config.checks import expect_entries_build, register_check
from hybridrl.config.schema import PPOConfig


@register_check("preflight")
def _check_tool_config(config: PPOConfig, problems: list[str]) -> None:
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable and multi_turn.tool_config_path is not None:
        from hybridrl.tools import initialize_tools_from_config

        expect_entries_build("actor_rollout_ref.rollout.multi_turn.tool_config_path", multi_turn.tool_config_path,
                             initialize_tools_from_config, "a tool YAML", problems)
