"""The run config as verl hands it to an agent loop: hybridrl's config, plus verl's keys that hybridrl keeps elsewhere.

hybridrl's schema uses verl's key names, so most of what a verl loop reads (`self.config.actor_rollout_ref.rollout.
multi_turn.max_user_turns`, `self.data_config.get("apply_chat_template_kwargs", {})`,
`self.rollout_config.full_determinism`) is already there. A few keys of verl's schema are, in verl itself, derived
from others; a loop reads them all the same. VERL_KEYS says, for each, the key path of hybridrl's config its value
comes from (verl's YAML interpolates the same one).

Every other key reads as it does on hybridrl's config (attribute, `.get`, `[]`, `in`); a key neither has raises
AttributeError naming its full path, as a loop reading it would on verl's config without that key.
"""
from __future__ import annotations

from typing import Any, Optional


VERL_KEYS: dict[str, str] = {
    # verl's data config: `tool_config_path: ${oc.select:actor_rollout_ref.rollout.multi_turn.tool_config_path,null}`
    "data.tool_config_path": "actor_rollout_ref.rollout.multi_turn.tool_config_path",
}


class VerlConfigView:
    """A node of the run config with verl's keys added (VERL_KEYS); read-only, like the config a loop gets."""

    __slots__ = ("_node", "_path", "_root")

    def __init__(self, node: Any, path: str = "", root: Any = None) -> None:
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_root", node if root is None else root)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        found, value = self._lookup(key)
        if not found:
            raise AttributeError(f"the run config has no key {self._child_path(key)!r} (neither hybridrl's schema "
                                 f"nor verl's keys it maps: hybridrl.agent_loop.verl_config.VERL_KEYS)")
        return value

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{self._child_path(key)}: the config an agent loop gets is read-only")

    def get(self, key: str, default: Any = None) -> Any:
        found, value = self._lookup(key)
        return value if found else default

    def __getitem__(self, key: str) -> Any:
        found, value = self._lookup(key)
        if not found:
            raise KeyError(self._child_path(key))
        return value

    def __contains__(self, key: str) -> bool:
        return self._lookup(key)[0]

    def __repr__(self) -> str:
        return f"VerlConfigView({self._path or '<root>'}: {self._node!r})"

    def _child_path(self, key: str) -> str:
        return f"{self._path}.{key}" if self._path else key

    def _lookup(self, key: str) -> tuple[bool, Any]:
        """(whether the key exists, its value: a view again when it is a config node)."""
        path = self._child_path(key)
        if _has_key(self._node, key):
            return True, self._wrap(_read(self._node, key), path)
        source = VERL_KEYS.get(path)
        if source is not None:
            node = self._root
            for part in source.split("."):
                node = _read(node, part)
            return True, self._wrap(node, path)
        return False, None

    def _wrap(self, value: Any, path: str) -> Any:
        return VerlConfigView(value, path, self._root) if hasattr(value, "__dataclass_fields__") else value

    def __reduce__(self):
        return VerlConfigView, (self._node, self._path, self._root)


def _has_key(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        return key in node
    return key in getattr(node, "__dataclass_fields__", {})


def _read(node: Any, key: str) -> Any:
    return node[key] if isinstance(node, dict) else getattr(node, key)


def verl_config(config: Any) -> Any:
    """`config` as verl hands it to a loop (a view; a view or a non-config value comes back as it is)."""
    if isinstance(config, VerlConfigView) or not hasattr(config, "__dataclass_fields__"):
        return config
    return VerlConfigView(config)


def unwrap(config: Any) -> Optional[Any]:
    """hybridrl's own config node behind a view (what hybridrl's code that needs the dataclass takes)."""
    return config._node if isinstance(config, VerlConfigView) else config
