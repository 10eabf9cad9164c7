"""Tools from a YAML file (verl's `initialize_tools_from_config`), checked entry by entry before any rollout.

    tools:
      - class_name: hybridrl.tools.gsm8k_tool.Gsm8kTool    # module.Class, a subclass of BaseTool
        config: {type: native}                             # handed to the tool; type: native (verl's default)
        tool_schema:                                       # OpenAI function schema, validated; null: the
                                                           # class's get_openai_tool_schema() gives it
          type: function
          function: {name: calc_gsm8k_reward, description: ..., parameters: {type: object, properties: ..., required: [...]}}

Every error names the file, the entry (index and function name) and what was expected. verl's MCP
and benchmax tool types are refused: only `type: native` tools exist here.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from omegaconf import OmegaConf
from pydantic import ValidationError

from hybridrl.tools.base_tool import BaseTool
from hybridrl.tools.schemas import OpenAIFunctionToolSchema
from hybridrl.utils.import_utils import import_dotted

ENTRY_KEYS = {"class_name", "config", "tool_schema"}


class ToolConfigError(ValueError):
    """A tool YAML that cannot give working tools; the message names the file and the entry."""


def get_tool_class(cls_name: str) -> type:
    """The class at `module.Class` (verl's name); ImportError/AttributeError as Python raises them."""
    return import_dotted(cls_name)


def initialize_tools_from_config(tools_config_file: str) -> list[BaseTool]:
    """One instance per YAML entry, in file order; tool names must be unique."""
    entries = _read_entries(tools_config_file)
    tools: list[BaseTool] = []
    for index, entry in enumerate(entries):
        tools.append(_build_tool(tools_config_file, index, entry))
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        if tool.name in seen:
            raise ToolConfigError(f"{tools_config_file}: tools[{index}] and tools[{seen[tool.name]}] are both "
                                  f"named {tool.name!r}; tool names must be unique")
        seen[tool.name] = index
    return tools


def _read_entries(path: str) -> list:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tool config {path!r}: no such file")
    try:
        document = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as error:  # noqa: BLE001 - YAML and interpolation errors, with the file named
        raise ToolConfigError(f"{path}: cannot read as YAML: {error}") from error
    if not isinstance(document, dict) or not isinstance(document.get("tools"), list):
        raise ToolConfigError(f"{path}: expected a mapping with a list under 'tools', got {document!r}")
    return document["tools"]


def _build_tool(path: str, index: int, entry: Any) -> BaseTool:
    where = f"{path}: tools[{index}]"
    if not isinstance(entry, dict):
        raise ToolConfigError(f"{where}: expected a mapping with class_name, config, tool_schema; got {entry!r}")
    if isinstance(entry.get("tool_schema"), dict):
        name = (entry["tool_schema"].get("function") or {}).get("name") if isinstance(
            entry["tool_schema"].get("function"), dict) else None
        where += f" ({name!r})" if name else ""
    unknown = set(entry) - ENTRY_KEYS
    if unknown:
        raise ToolConfigError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(ENTRY_KEYS)}")
    config = entry.get("config") if entry.get("config") is not None else {}
    if not isinstance(config, dict):
        raise ToolConfigError(f"{where}: config must be a mapping, got {config!r}")
    if config.get("type", "native") != "native":
        raise ToolConfigError(f"{where}: config.type={config['type']!r}; only 'native' tools are supported "
                              "(verl's mcp/benchmax tool types are not)")
    tool_cls = _tool_class(where, entry.get("class_name"))
    tool_schema = _tool_schema(where, entry.get("tool_schema"))
    try:
        return tool_cls(config=config, tool_schema=tool_schema)
    except Exception as error:
        raise ToolConfigError(f"{where}: {entry['class_name']}(config={config!r}) failed: "
                              f"{type(error).__name__}: {error}") from error


def _tool_class(where: str, class_name: Any) -> type:
    if not isinstance(class_name, str) or "." not in class_name:
        raise ToolConfigError(f"{where}: class_name must be a 'module.Class' string, got {class_name!r}")
    try:
        tool_cls = get_tool_class(class_name)
    except (ImportError, AttributeError) as error:
        raise ToolConfigError(f"{where}: cannot import class_name {class_name!r}: "
                              f"{type(error).__name__}: {error}") from error
    if not (isinstance(tool_cls, type) and issubclass(tool_cls, BaseTool)):
        raise ToolConfigError(f"{where}: class_name {class_name!r} is {tool_cls!r}, expected a subclass of "
                              "hybridrl.tools.base_tool.BaseTool")
    return tool_cls


def _tool_schema(where: str, schema: Any) -> Optional[OpenAIFunctionToolSchema]:
    """The entry's validated schema; None (tool_schema: null or absent) leaves it to the class's
    get_openai_tool_schema() (BaseTool refuses a class that has none, and the error names this entry)."""
    if schema is None:
        return None
    try:
        return OpenAIFunctionToolSchema.model_validate(schema)
    except ValidationError as error:
        problems = "; ".join(f"tool_schema.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ToolConfigError(f"{where}: invalid tool_schema: {problems}") from error
