"""hybridrl's packages form layers: a module imports only from its own package and the packages below it, so a
package can be read, tested and changed knowing only what lies below, and no import loop can form.

The order, lowest first (the order the code holds; issue #32 proposed agent_loop below tools and interactions, but
the tool agent loop imports both to run tools and interactions, so agent_loop sits above them):

    utils, protocol, config, single_controller, algorithms, models, data, reward, workers, tools, interactions,
    agent_loop, trainer, checks (hybridrl/checks.py), defaults, compat, then the entry points (main_ppo.py,
    model_merger.py; trainer/main_sft.py is the trainer's).

`utils` may be imported by every package; `protocol` by every package but utils. `config` imports nothing of
hybridrl but utils: the subsystems register their config checks with it (config/checks.py), and hybridrl/checks.py
imports them. Imports are read with `ast` at any depth (inside functions too); config's string constants are read as
well, so that an importlib string naming a subsystem's module counts as an import. Runtime code imports no
config_checks module: checks run once, before the start (hybridrl/checks.py gathers them).
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

HYBRIDRL = pathlib.Path(__file__).resolve().parent.parent / "hybridrl"

LAYERS = ["utils", "protocol", "config", "single_controller", "algorithms", "models", "data", "reward", "workers",
          "tools", "interactions", "agent_loop", "trainer", "dashboard", "checks", "defaults", "compat", "entry points"]
ENTRY_POINTS = {"hybridrl", "hybridrl.main_ppo", "hybridrl.model_merger"}
IMPORTED_BY_ALL = {"utils"}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(HYBRIDRL.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(HYBRIDRL.rglob("*.py"))}


def layer(module: str) -> str:
    return "entry points" if module in ENTRY_POINTS else module.split(".")[1]


def known_module(name: str) -> str | None:
    """`name` itself when it is a module of hybridrl, else its closest enclosing module (an attribute imported)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def imports_of(module: str, source: str) -> set[str]:
    """The hybridrl modules `module` imports, at any depth: `from pkg import sub` imports pkg.sub when that is a
    module, else pkg."""
    package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        found |= {target for name in names if name.startswith("hybridrl")
                  for target in [known_module(name)] if target is not None and target != module}
    return found


def import_graph(extra: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the modules it imports; `extra` adds source lines to modules (the tests' own forbidden imports)."""
    extra = extra or {}
    return {module: imports_of(module, path.read_text() + "\n" + extra.get(module, ""))
            for module, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import loop, as the path of modules that closes it (depth-first search)."""
    found, state, stack = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                found.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def config_escapes(graph: dict[str, set[str]]) -> list[str]:
    """config's imports outside config and utils, and its string constants that name a module outside them."""
    allowed = {"config", "utils"}
    found = [f"{module} -> {target}" for module, targets in graph.items() if layer(module) == "config"
             for target in sorted(targets) if layer(target) not in allowed]
    for module, path in MODULES.items():
        if layer(module) != "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = re.match(r"hybridrl\.(\w+)", node.value)
                if named and named.group(1) not in allowed:
                    found.append(f"{module} -> {node.value!r} (a string naming a module)")
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a package from a package at or above it in LAYERS (utils excepted), one line each."""
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            own, other = layer(module), layer(target)
            if own == other or other in IMPORTED_BY_ALL:
                continue
            if LAYERS.index(other) > LAYERS.index(own) or own in IMPORTED_BY_ALL:
                found.append(f"{module} ({own}) -> {target} ({other})")
    return found


def config_checks_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a subsystem's config_checks module from runtime code: a rule is checked once, before the start, by
    hybridrl.checks (the one module that gathers them) and the other config_checks modules; runtime code that needs
    a shared rule imports the runtime module it lives in (e.g. data/route.py), never a check."""
    gatherers = {"hybridrl.checks"}
    return [f"{module} -> {target}" for module, targets in sorted(graph.items())
            if module not in gatherers and not module.endswith(".config_checks")
            for target in sorted(targets) if target.endswith(".config_checks")]


def test_every_package_has_a_layer():
    assert sorted({layer(module) for module in MODULES} - set(LAYERS)) == []


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_config_imports_only_config_and_utils():
    assert config_escapes(import_graph()) == []


def test_packages_import_only_the_layers_below():
    assert upward_imports(import_graph()) == []


def test_runtime_code_imports_no_config_checks():
    assert config_checks_imports(import_graph()) == []


@pytest.mark.parametrize("module, line, check", [
    ("hybridrl.config.validation", "from hybridrl.trainer.tracking import VALID_LOGGERS", config_escapes),
    ("hybridrl.config.checks", "    from hybridrl.data import hooks", config_escapes),
    ("hybridrl.config.checks", "import hybridrl.protocol", config_escapes),
    ("hybridrl.reward.hub", "from hybridrl.workers.rollout import BaseRollout", upward_imports),
    ("hybridrl.utils.import_utils", "from hybridrl.protocol import DataProto", upward_imports),
    ("hybridrl.reward.custom_function", "from hybridrl.reward.hub import RewardHub", cycles),
    ("hybridrl.trainer.ppo.group_rollout", "from hybridrl.data.config_checks import DATA_FLOW_DEFAULTS",
     config_checks_imports),
    ("hybridrl.agent_loop.manager", "    import hybridrl.agent_loop.config_checks", config_checks_imports),
])
def test_a_forbidden_import_is_found(module, line, check):
    """The checks above can fail: each forbidden import, added to a module's source, is reported."""
    assert check(import_graph()) == []
    assert check(import_graph({module: line})) != []


def test_an_importlib_string_in_config_is_found(tmp_path, monkeypatch):
    path = tmp_path / "strings.py"
    path.write_text('import importlib\nimportlib.import_module(f"hybridrl.workers.rollout.{name}_rollout")\n')
    monkeypatch.setitem(MODULES, "hybridrl.config.strings", path)
    assert config_escapes(import_graph()) == ["hybridrl.config.strings -> 'hybridrl.workers.rollout.' (a string "
                                              "naming a module)"]
