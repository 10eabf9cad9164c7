"""Load a user's object (function or class) from a .py file named in the config.

Extension points in hybridrl are `path/name` config pairs (a custom reward function, a custom
rollout class, ...). This is the one place that turns such a pair into a Python object, so every
extension point fails the same way: naming the file and the missing name.
`load_extensions` imports the config's `extensions` (modules or .py files) for their @register_* side effects;
`import_dotted` imports the `module.Name` a YAML names (tools, interactions).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from typing import Any


def import_dotted(dotted: str) -> Any:
    """The object at `module.Name`; ImportError/AttributeError as Python raises them."""
    module_name, _, name = dotted.rpartition(".")
    if not module_name:
        raise ImportError(f"{dotted!r} is not a dotted module.Name path")
    return getattr(importlib.import_module(module_name), name)


class NameNotDefined(AttributeError):
    """The user's file ran, but defines no object of the configured name."""


def load_extern_object(path: str, name: str) -> Any:
    """Execute the file at `path` as a fresh module and return its attribute `name` (NameNotDefined if it has none).

    The module is deliberately NOT put in `sys.modules`: cloudpickle then ships the returned
    function by value, so Ray workers that never saw the file can still run it.
    """
    if not path:
        raise ValueError(f"load_extern_object: empty path (wanted object {name!r})")
    abs_path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(abs_path):
        raise FileNotFoundError(f"cannot load {name!r}: file {abs_path} does not exist")
    module = _exec_file_as_module(abs_path)
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise NameNotDefined(f"{abs_path} defines no {name!r}; names it defines: {public}")
    return getattr(module, name)


def _exec_file_as_module(abs_path: str):
    # A path-derived module name keeps two user files with the same basename apart in tracebacks.
    digest = hashlib.sha1(abs_path.encode()).hexdigest()[:8]
    stem = os.path.splitext(os.path.basename(abs_path))[0]
    spec = importlib.util.spec_from_file_location(f"hybridrl_extern_{stem}_{digest}", abs_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{abs_path} is not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Absolute paths of extension files already executed in this process: running a file twice would
# run its @register_* decorators twice (validate_config and the TaskRunner both load extensions).
_loaded_extension_files: set[str] = set()


def load_extensions(specs: list[str]) -> None:
    """Import each extension once, so that its @register_* decorators add its names to the registries.

    A spec ending in ".py" is a file path (executed like `load_extern_object` does, so what it
    registers ships to Ray workers by value); anything else is an importable module name.
    """
    for spec in specs:
        if not spec.endswith(".py"):
            importlib.import_module(spec)
            continue
        abs_path = os.path.abspath(os.path.expanduser(spec))
        if not os.path.isfile(abs_path):
            raise FileNotFoundError(f"extension file {abs_path} does not exist")
        if abs_path not in _loaded_extension_files:
            _exec_file_as_module(abs_path)
            _loaded_extension_files.add(abs_path)
