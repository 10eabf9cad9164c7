"""Config check of the interactions, registered with hybridrl.config.checks: before the start, the interactions of
multi_turn.interaction_config_path build here as each agent-loop worker will build them, so a missing class is
refused now, naming the file and the entry (the registry's message)."""
from __future__ import annotations

from hybridrl.config.checks import expect_entries_build, register_check
from hybridrl.config.schema import PPOConfig


@register_check("preflight")
def _check_interaction_config(config: PPOConfig, problems: list[str]) -> None:
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable and multi_turn.interaction_config_path is not None:
        from hybridrl.interactions import initialize_interactions_from_config

        expect_entries_build("actor_rollout_ref.rollout.multi_turn.interaction_config_path",
                             multi_turn.interaction_config_path, initialize_interactions_from_config,
                             "an interaction YAML", problems)
