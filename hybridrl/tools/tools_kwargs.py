"""Per-sample tool arguments: `extra_info.tools_kwargs` of a dataset row (verl's layout).

    extra_info.tools_kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"},
                                                     "execute_kwargs": {...}, "calc_reward_kwargs": {...},
                                                     "release_kwargs": {...}}}

verl's tool_agent_loop passes them nested, `await tool.create(create_kwargs={...})`, and verl's tools
(ours too) read them from there; older verl rollouts spread them, `tool.create(**create_kwargs)`.
`tool_phase_kwargs(tools_kwargs, name, "create")` gives the keyword arguments for that call ({}
when the row has none); a misspelt phase key or a non-mapping is an error, never ignored. A None
entry counts as absent: parquet stores a struct column, so rows get None for other rows' keys.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

PHASES = ("create", "execute", "calc_reward", "release")
PHASE_KEYS = tuple(f"{phase}_kwargs" for phase in PHASES)


def check_tools_kwargs(tools_kwargs: Optional[dict], tool_names: Iterable[str], where: str = "extra_info") -> None:
    """Raise naming `where` when tools_kwargs names an unknown tool or phase key, or holds a non-mapping."""
    if tools_kwargs is None:
        return
    if not isinstance(tools_kwargs, dict):
        raise ValueError(f"{where}.tools_kwargs must be a mapping of tool name -> phase kwargs, got {tools_kwargs!r}")
    known = set(tool_names)
    for name, per_tool in tools_kwargs.items():
        if per_tool is None:  # parquet gives every row every tool's key; None where the row has none
            continue
        if name not in known:
            raise ValueError(f"{where}.tools_kwargs names tool {name!r}, not among the configured tools "
                             f"{sorted(known)}")
        if not isinstance(per_tool, dict):
            raise ValueError(f"{where}.tools_kwargs[{name!r}] must be a mapping with keys among {list(PHASE_KEYS)}, "
                             f"got {per_tool!r}")
        unknown = set(per_tool) - set(PHASE_KEYS)
        if unknown:
            raise ValueError(f"{where}.tools_kwargs[{name!r}] has keys {sorted(unknown)}; expected keys among "
                             f"{list(PHASE_KEYS)}")
        for key, value in per_tool.items():
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{where}.tools_kwargs[{name!r}].{key} must be a mapping, got {value!r}")


def tool_phase_kwargs(tools_kwargs: Optional[dict], tool_name: str, phase: str) -> dict[str, Any]:
    """The kwargs for `phase` (create / execute / calc_reward / release) of `tool_name`; {} when absent."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {list(PHASES)}, got {phase!r}")
    per_tool = (tools_kwargs or {}).get(tool_name) or {}
    if not isinstance(per_tool, dict):
        raise ValueError(f"tools_kwargs[{tool_name!r}] must be a mapping, got {per_tool!r}")
    unknown = set(per_tool) - set(PHASE_KEYS)
    if unknown:
        raise ValueError(f"tools_kwargs[{tool_name!r}] has keys {sorted(unknown)}; expected keys among "
                         f"{list(PHASE_KEYS)}")
    value = per_tool.get(f"{phase}_kwargs") or {}
    if not isinstance(value, dict):
        raise ValueError(f"tools_kwargs[{tool_name!r}].{phase}_kwargs must be a mapping, got {value!r}")
    return dict(value)
