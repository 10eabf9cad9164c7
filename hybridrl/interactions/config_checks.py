"""Config check of the interactions, registered with hybridrl.config.checks: before the start, the interactions of
multi_turn.interaction_config_path build here as each agent-loop worker will build them, so a missing class is
refused now, naming the file and the entry (the registry's message)."""
from __future__ import annotations

from hybridrl.config.checks import register_check
from hybridrl.config.schema import PPOConfig


@register_check("preflight")
def _check_interaction_config(config: PPOConfig, problems: list[str]) -> None:
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    if not multi_turn.enable or multi_turn.interaction_config_path is None:
        return
    from hybridrl.interactions import initialize_interactions_from_config

    try:
        initialize_interactions_from_config(multi_turn.interaction_config_path)
    except Exception as err:  # the registry names file and entry; a class's own __init__ can raise anything
        problems.append(f"actor_rollout_ref.rollout.multi_turn.interaction_config_path: expected an interaction YAML "
                        f"whose every entry builds, got {multi_turn.interaction_config_path!r}: {err}")
