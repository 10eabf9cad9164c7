"""Which of verl's names a ported file imports that hybridrl.compat.verl does not provide, read from the file's source
before it is imported: a loop asking for one is refused before Ray starts, naming the verl symbol and the file,
where importing it would only say that some hybridrl module is missing."""
from __future__ import annotations

import ast
import importlib
import importlib.util

COMPAT = "hybridrl.compat.verl"


def unprovided_verl_imports(module_name: str) -> list[str]:
    """One line per verl module or name that `module_name`'s file imports through hybridrl.compat.verl and hybridrl
    lacks: "<file> line <n> imports <verl symbol>". [] when the module's file cannot be found or read (importing it
    then says why)."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return []
    with open(spec.origin) as f:
        tree = ast.parse(f.read(), filename=spec.origin)
    return [f"{spec.origin} line {line} imports {symbol}" for line, symbol in _unprovided(tree)]


def _unprovided(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, verl symbol) for each compat module the file imports that does not exist, and each name it imports
    from an existing compat module that the module lacks."""
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_compat(node.module or ""):
            if not _module_exists(node.module):
                missing.append((node.lineno, _verl_name(node.module)))
                continue
            module = importlib.import_module(node.module)
            missing += [(node.lineno, _verl_name(f"{node.module}.{alias.name}")) for alias in node.names
                        if alias.name != "*" and not hasattr(module, alias.name)
                        and not _module_exists(f"{node.module}.{alias.name}")]
        elif isinstance(node, ast.Import):
            missing += [(node.lineno, _verl_name(alias.name)) for alias in node.names
                        if _is_compat(alias.name) and not _module_exists(alias.name)]
    return sorted(missing)


def _is_compat(module: str) -> bool:
    return module == COMPAT or module.startswith(COMPAT + ".")


def _verl_name(compat_name: str) -> str:
    return "verl" + compat_name[len(COMPAT):]


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent is missing or is not a package
        return False
