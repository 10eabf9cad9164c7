"""Check a composed config against the schema dataclasses, key by key, collecting every problem.

Three steps, each usable on its own:
  `to_plain`         DictConfig -> plain dicts/lists, resolving interpolations one key at a time,
                     so one broken `${...}` is reported without hiding the rest of the tree
                     (and noting which keys were interpolated);
  `check_structure`  plain dict vs a dataclass: unknown keys (with a did-you-mean), missing keys,
                     types, choices and single-key ranges; returns the converted values;
  `build`            converted values -> dataclass instances (only called when nothing was wrong).

Type conversions, all deliberate and small: an int is accepted where a float is expected and a
float-looking string ("1e-6", which YAML 1.1 reads as a string) becomes a float, and a field
marked `one_or_list()` in the schema takes one bare string as a list of one. Bools are strict:
1, "true" and "yes" are not bools.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from typing import Any, Literal, Union

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException


class _Invalid:
    """Marks a value already reported as a problem, so later rules skip it instead of re-reporting."""

    def __repr__(self) -> str:
        return "<invalid>"


INVALID = _Invalid()


def to_plain(node: Any, path: str, problems: list[str], interpolations: dict[str, str]) -> Any:
    """Plain Python copy of `node` with interpolations resolved; unresolvable keys become INVALID.

    `interpolations` receives `path -> "${...}"` for every interpolated key, so that a problem
    with a value the user did not write can say where it came from.
    """
    if isinstance(node, DictConfig):
        return {key: _resolve_child(node, key, _join(path, key), problems, interpolations) for key in node.keys()}
    if isinstance(node, ListConfig):
        return [_resolve_child(node, index, f"{path}[{index}]", problems, interpolations)
                for index in range(len(node))]
    return node


def _resolve_child(parent: DictConfig | ListConfig, key: Any, path: str, problems: list[str],
                   interpolations: dict[str, str]) -> Any:
    child = parent._get_node(key)
    if child._is_interpolation():
        interpolations[path] = child._value()
    try:
        value = parent[key]
    except OmegaConfBaseException as err:
        reason = str(err).splitlines()[0]
        problems.append(f"{path}: expected a resolvable value, got {child._value()!r} ({reason})")
        return INVALID
    return to_plain(value, path, problems, interpolations)


def check_structure(schema: type, data: Any, path: str, problems: list[str]) -> Any:
    """Check `data` against the dataclass `schema`; returns a dict of converted values (INVALID where wrong)."""
    if not isinstance(data, dict):
        problems.append(f"{path or '<root>'}: expected a mapping of {schema.__name__} keys, got {data!r}")
        return INVALID
    hints = _type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for unknown in sorted(set(data) - set(fields)):
        problems.append(_unknown_key_message(_join(path, unknown), data[unknown], list(fields), path))
    checked = {}
    for name, spec in fields.items():
        key_path = _join(path, name)
        if name not in data:
            problems.append(f"{key_path}: expected {describe(hints[name])}, got nothing (key missing)")
            checked[name] = INVALID
            continue
        normalize = spec.metadata.get("normalize", lambda v: v)
        value = check_value(hints[name], normalize(data[name]), key_path, problems)
        check = spec.metadata.get("check")
        if check is not None and value is not None and value is not INVALID and not check(value):
            problems.append(f"{key_path}: expected {spec.metadata['expected']}, got {value!r}")
            value = INVALID
        checked[name] = value
    return checked


def check_value(expected: Any, value: Any, path: str, problems: list[str]) -> Any:
    """Check one value against a type annotation; returns the converted value or INVALID."""
    if value is INVALID:
        return INVALID
    if dataclasses.is_dataclass(expected):
        return check_structure(expected, value, path, problems)
    converted = _convert(expected, value)
    if converted is INVALID:
        problems.append(f"{path}: expected {describe(expected)}, got {value!r}")
    return converted


def _convert(expected: Any, value: Any) -> Any:
    """`value` converted to the type `expected`, or INVALID when it is not of that type."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if expected is Any:
        return value
    if origin is Union:
        if value is None:
            return None if type(None) in args else INVALID
        for option in (a for a in args if a is not type(None)):
            converted = _convert(option, value)
            if converted is not INVALID:
                return converted
        return INVALID
    if origin is Literal:
        return value if value in args and not isinstance(value, bool) else INVALID
    if origin is list:
        if not isinstance(value, list):
            return INVALID
        items = [_convert(args[0], item) for item in value]
        return INVALID if any(item is INVALID for item in items) else items
    if origin is dict:
        return value if isinstance(value, dict) else INVALID
    if expected is bool:
        return value if isinstance(value, bool) else INVALID
    if expected is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else INVALID
    if expected is float:
        return _to_float(value)
    if expected is str:
        return value if isinstance(value, str) else INVALID
    raise TypeError(f"schema uses a type the checker does not know: {expected!r}")


def _to_float(value: Any) -> Any:
    if isinstance(value, bool):
        return INVALID
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return INVALID
    return INVALID


def describe(expected: Any) -> str:
    """Human wording of a type annotation, as used in error messages."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if dataclasses.is_dataclass(expected):
        return f"a mapping of {expected.__name__} keys"
    if origin is Union:
        words = [describe(a) for a in args if a is not type(None)]
        if type(None) in args:
            words.append("null")
        return " or ".join(words)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of ({describe(args[0])})"
    if origin is dict:
        return "a mapping"
    if expected is Any:
        return "any value"
    return expected.__name__


def build(schema: type, checked: dict) -> Any:
    """Instantiate `schema` (recursively) from the values `check_structure` returned."""
    hints = _type_hints(schema)
    kwargs = {}
    for spec in dataclasses.fields(schema):
        value = checked[spec.name]
        kwargs[spec.name] = build(hints[spec.name], value) if dataclasses.is_dataclass(hints[spec.name]) else value
    return schema(**kwargs)


def schema_key_paths(schema: type, prefix: str = "") -> set[str]:
    """Every leaf key path the schema defines (dict-typed keys count as leaves)."""
    paths = set()
    for name, hint in _type_hints(schema).items():
        path = _join(prefix, name)
        paths |= schema_key_paths(hint, path) if dataclasses.is_dataclass(hint) else {path}
    return paths


@functools.cache
def _type_hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _unknown_key_message(key_path: str, value: Any, known: list[str], parent: str) -> str:
    key = key_path.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {_join(parent, close[0])}?" if close else f"known keys here: {', '.join(sorted(known))}"
    return f"{key_path}: expected a known key, got unknown key (value {value!r}); {hint}"


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
