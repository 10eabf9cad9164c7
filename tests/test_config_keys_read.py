"""Every config key is read or refused: a key the YAML accepts but no code reads is a silent no-op.

The rule (a conservative static scan, no run needed):
  a schema key (a leaf of the dataclasses in hybridrl/config/schema.py, e.g. `critic.model.fsdp_config.fsdp_size`)
  is REFUSED when validation pins it: listed in validation.NOT_IMPLEMENTED, DEPRECATED, SET_ELSEWHERE or SAME_AS;
  otherwise it is READ when its last name (`fsdp_size`) occurs in a .py file under hybridrl/ outside
  hybridrl/config/ (validation and preflight only check values, they do not use them) either as an attribute
  access (`fsdp_config.fsdp_size`) or as a whole string constant (`cfg.get("fsdp_size")`, `cfg["fsdp_size"]`).
The SFT config (hybridrl/trainer/main_sft.py) is held to the same rule.
Comments and docstring prose do not count (only AST attribute names and exact string constants).
Known limit: keys that share a last name (`forward_prefetch` of actor, ref, critic, reward model) count as read
when any one of them is; give such keys the same treatment everywhere (they have it today).
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

import pytest

from hybridrl.config import schema, validation
from hybridrl.trainer import main_sft

HYBRIDRL = pathlib.Path(__file__).resolve().parent.parent / "hybridrl"


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted paths of every leaf field under the dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    keys = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            keys += schema_keys(hint, f"{prefix}{field.name}.")
        else:
            keys.append(prefix + field.name)
    return keys


def names_used(sources: list[str]) -> set[str]:
    """Attribute names and whole string constants in the given Python sources."""
    used = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.add(node.value)
    return used


def code_sources() -> list[str]:
    return [path.read_text() for path in sorted(HYBRIDRL.rglob("*.py"))
            if path.relative_to(HYBRIDRL).parts[0] != "config"]


def refused_keys() -> set[str]:
    return (set(validation.NOT_IMPLEMENTED) | set(validation.DEPRECATED) | set(validation.SET_ELSEWHERE)
            | set(validation.SAME_AS))


def unread_keys(root: type, sources: list[str], refused: set[str]) -> list[str]:
    used = names_used(sources)
    return [key for key in schema_keys(root) if key not in refused and key.rsplit(".", 1)[-1] not in used]


def test_every_schema_key_is_read_or_refused():
    assert unread_keys(schema.PPOConfig, code_sources(), refused_keys()) == []


def test_every_sft_config_key_is_read():
    """The SFT trainer's schema (hybridrl/trainer/main_sft.py) under the same rule; it refuses no key."""
    assert unread_keys(main_sft.SFTConfig, code_sources(), set()) == []


def test_every_refused_key_is_a_schema_key():
    """A stale entry (a key renamed or removed from the schema) would refuse nothing."""
    assert refused_keys() - set(schema_keys(schema.PPOConfig)) == set()


@dataclasses.dataclass
class _Inner:
    read_leaf: int
    never_read_leaf_xyz: int


@dataclasses.dataclass
class _Root:
    inner: _Inner
    refused_leaf_xyz: bool
    read_by_get: str


@pytest.mark.parametrize("refused, expected", [(set(), ["inner.never_read_leaf_xyz", "refused_leaf_xyz"]),
                                               ({"refused_leaf_xyz"}, ["inner.never_read_leaf_xyz"])])
def test_the_audit_catches_a_key_nobody_reads(refused, expected):
    code = "def f(cfg):\n    return cfg.inner.read_leaf, cfg.get('read_by_get')  # never_read_leaf_xyz\n"
    assert unread_keys(_Root, [code], refused) == expected
