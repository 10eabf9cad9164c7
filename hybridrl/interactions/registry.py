"""Interactions from a YAML file (verl's `initialize_interactions_from_config`), checked entry by entry.

    interaction:
      - name: gsm8k                                                  # optional: else the class name, lower case,
        class_name: hybridrl.interactions.gsm8k_interaction.Gsm8kInteraction   # without "Interaction"
        config: {}                                                   # handed to the interaction, with its name

Every error names the file, the entry and what was expected; names must be unique.
"""
from __future__ import annotations

import os
from typing import Any

from omegaconf import OmegaConf

from hybridrl.interactions.base import BaseInteraction
from hybridrl.utils.import_utils import import_dotted

ENTRY_KEYS = {"name", "class_name", "config"}


def get_interaction_class(cls_name: str) -> type:
    """The class at `module.Class` (verl's name); ImportError/AttributeError as Python raises them."""
    return import_dotted(cls_name)


def initialize_interactions_from_config(interaction_config_file: str) -> dict[str, BaseInteraction]:
    """name -> instance, one per YAML entry."""
    interactions: dict[str, BaseInteraction] = {}
    for index, entry in enumerate(_read_entries(interaction_config_file)):
        where = f"{interaction_config_file}: interaction[{index}]"
        name, interaction = _build_interaction(where, entry)
        if name in interactions:
            raise ValueError(f"{where}: a second interaction named {name!r}; interaction names must be unique")
        interactions[name] = interaction
    return interactions


def _read_entries(path: str) -> list:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"interaction config {path!r}: no such file")
    document = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(document, dict) or not isinstance(document.get("interaction"), list):
        raise ValueError(f"{path}: expected a mapping with a list under 'interaction', got {document!r}")
    return document["interaction"]


def _build_interaction(where: str, entry: Any) -> tuple[str, BaseInteraction]:
    if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
        raise ValueError(f"{where}: expected a mapping with a 'module.Class' string class_name, got {entry!r}")
    unknown = set(entry) - ENTRY_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(ENTRY_KEYS)}")
    class_name = entry["class_name"]
    try:
        interaction_cls = get_interaction_class(class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{where}: cannot import class_name {class_name!r}: {type(error).__name__}: {error}") \
            from error
    if not (isinstance(interaction_cls, type) and issubclass(interaction_cls, BaseInteraction)):
        raise ValueError(f"{where}: class_name {class_name!r} is {interaction_cls!r}, expected a subclass of "
                         f"hybridrl.interactions.BaseInteraction")
    config = dict(entry.get("config") or {})
    name = entry.get("name") or _default_name(class_name)
    config["name"] = name
    return name, interaction_cls(config=config)


def _default_name(class_name: str) -> str:
    """verl's default: Gsm8kInteraction -> gsm8k."""
    simple = class_name.rsplit(".", 1)[-1]
    return (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()
