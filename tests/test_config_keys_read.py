"""Every config key is read or refused: a key the YAML accepts but no code reads is a silent no-op.

The rule (a conservative static scan, no run needed):
  a schema key (a leaf of the dataclasses in hybridrl/config/schema.py, e.g. `reward_model.model.external_lib`)
  is REFUSED when validation pins it: listed in validation.NOT_IMPLEMENTED, DEPRECATED, SET_ELSEWHERE or SAME_AS,
  or is verl's name of one of ours (validation.ALIASES: validation copies its value to our key, which code reads);
  otherwise it is READ when code under hybridrl/ outside hybridrl/config/, hybridrl/compat/ and the subsystems' config_checks.py
  (checks judge values, they do not use them; the config classes' own methods in schema.py do count) reads that
  full path.
The SFT config (hybridrl/trainer/main_sft.py) is held to the same rule.

How the scan knows which config an access reads: it follows values, not names. A value has a config path when it is
  - a parameter annotated with a schema class that sits at one path (`config: PPOConfig`, `config: SFTConfig`),
  - a parameter its function's docstring documents as a section ("config: the `reward_model` section"),
  - a parameter of a function or class called with a value that has one (`CriticWorker(self.config.critic, ...)`,
    `RayClassWithInitArgs(RewardModelWorker, self.config.reward_model, ...)`, `X.options(...).remote(config)`), the
    callee found by a name defined once under hybridrl/ (or `self.method` of the caller's class); a parameter
    called with several (build_optimizer gets the actor's and the critic's optim) has each of them,
  - a name or `self.attribute` assigned one (`rm = config.reward_model`; `self.config = config` in any method, seen
    in every method of the class and its subclasses), or `a or b` of such values,
  - listed in ROOTS, for what the code cannot say (e.g. a config reached through an object of another library),
and an access is `value.name`, `getattr(value, "name")`, `value.get("name")` or `value["name"]` of such a value.
What it cannot see, so does not count: an access on a value it could not follow (a method call on another object,
a container of configs, a name defined twice); such an access reads nothing, whatever its last name, and a key read
only so shows up as unread: follow it with ROOTS. Comments and docstring prose never count as reads.
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import typing
from collections import defaultdict

import pytest

from hybridrl.config import schema, validation
from hybridrl.trainer import main_sft

HYBRIDRL = pathlib.Path(__file__).resolve().parent.parent / "hybridrl"
OBJECT = "object:"  # a value that is an instance of a class under hybridrl/: "object:<module>:<class>"
SELF = ("self", "cls")  # a method's own instance or class: `self.x` / `cls.x` is an attribute of its class

# (module under hybridrl/, function or class qualname, variable) -> config path, where the code cannot say it.
ROOTS = {
    # main_ppo.main: the config validate_config (under config/, not scanned) returns.
    ("main_ppo.py", "main", "config"): "",
    # Classes and functions the config names, built or called by a registry or a class looked up at run time.
    ("data/rl_dataset.py", "RLHFDataset.__init__", "config"): "data",
    ("agent_loop/tool_agent.py", "ToolAgentLoop.init_class", "config"): "",
    ("workers/rollout/hf_rollout.py", "HFRollout.__init__", "config"): "actor_rollout_ref.rollout",
    ("workers/rollout/vllm_rollout.py", "VLLMRollout.__init__", "config"): "actor_rollout_ref.rollout",
    ("workers/rollout/sglang_rollout.py", "SGLangRollout.__init__", "config"): "actor_rollout_ref.rollout",
    **{("algorithms/losses.py", f"compute_policy_loss_{name}", "config"): "actor_rollout_ref.actor"
       for name in ("vanilla", "gspo", "gpg", "clip_cov", "kl_cov")},
    **{("algorithms/alternative_losses.py", f"compute_policy_loss_{name}", "config"): "actor_rollout_ref.actor"
       for name in ("cispo", "dppo_tv", "dppo_kl", "sapo", "geo_mean", "dro", "bypass_mode")},
    ("algorithms/core_algos.py", "compute_gdpo_outcome_advantage", "config"): "algorithm",
    ("reward/managers/dapo.py", "DAPORewardManager.__init__", "overlong_buffer_cfg"): "reward_model.overlong_buffer",
    # Agent loops get the run config wrapped (verl's DictConfigWrap) and keep it as self.config.
    ("agent_loop/base.py", "AgentLoopBase", "self.config"): "",
    ("agent_loop/base.py", "AgentLoopBase", "self.data_config"): "data",
    ("agent_loop/base.py", "AgentLoopBase", "self.rollout_config"): "actor_rollout_ref.rollout",
}


def schema_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted paths of every leaf field under the dataclass `cls`."""
    return [path for path, hint in schema_nodes(cls, prefix).items() if not is_config_class(hint)]


def is_config_class(hint) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def schema_nodes(cls: type, prefix: str = "") -> dict[str, type]:
    """Every path under `cls` (sections and leaves) with its type hint; the root is ""."""
    nodes = {prefix.rstrip("."): cls} if not prefix else {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        nodes[prefix + field.name] = hint
        if is_config_class(hint):
            nodes.update(schema_nodes(hint, f"{prefix}{field.name}."))
    return nodes


def join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class ConfigReads:
    """The full config paths that `sources` ({module path: source}) read, under the schema rooted at `root`."""

    def __init__(self, root: type, sources: dict[str, str], roots: dict[tuple[str, str, str], str]):
        self.nodes = {"": root, **schema_nodes(root)}
        paths_of_class = defaultdict(set)
        for path, hint in self.nodes.items():
            if is_config_class(hint):
                paths_of_class[hint.__name__].add(path)
        self.class_path = {name: paths.pop() for name, paths in paths_of_class.items() if len(paths) == 1}
        self.trees = {module: ast.parse(source) for module, source in sources.items()}
        self.scopes: dict[tuple[str, str], ast.AST] = {}  # (module, qualname) -> function or class node
        self.bases: dict[tuple[str, str], list[str]] = {}  # class -> the names of its bases
        definitions = defaultdict(list)
        for module, tree in self.trees.items():
            self._index(module, tree, "", definitions)
        self.unique = {name: places[0] for name, places in definitions.items() if len(places) == 1}
        self.bound: dict[tuple[str, str, str], set[str]] = defaultdict(set)
        self.keys: dict[tuple[str, str, str], set[str]] = defaultdict(set)  # parameters given key names
        for key, path in roots.items():
            if path in self.nodes:  # an entry of the other schema (PPO or SFT) binds nothing here
                self.bound[key].add(path)
        self._seed()
        self.constants = {module: _string_collections(tree) for module, tree in self.trees.items()}
        self.read: set[str] = set()
        for _ in range(20):  # to a fixed point: each round may bind what the next one follows
            before = sum(len(paths) for paths in self.bound.values()) + sum(map(len, self.keys.values()))
            for (module, qualname), node in self.scopes.items():
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._propagate(module, qualname, node)
            if sum(len(paths) for paths in self.bound.values()) + sum(map(len, self.keys.values())) == before:
                break
        for (module, qualname), node in self.scopes.items():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for child in self._own_nodes(node):
                    self.read |= {path for path in self.resolve(child, module, qualname)
                                  if path in self.nodes and not is_config_class(self.nodes[path])}

    # ---- the code's functions and classes
    def _index(self, module: str, node: ast.AST, prefix: str, definitions) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = prefix + child.name
                self.scopes[(module, qualname)] = child
                if not prefix:
                    definitions[child.name].append((module, qualname))
                if isinstance(child, ast.ClassDef):
                    self.bases[(module, qualname)] = [ast.unparse(base).rsplit(".", 1)[-1] for base in child.bases]
                self._index(module, child, qualname + ".", definitions)

    def _own_nodes(self, function: ast.AST):
        """The nodes of `function`'s body, without those of the functions and classes defined in it."""
        stack = list(ast.iter_child_nodes(function))
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.extend(ast.iter_child_nodes(node))

    def _classes_of(self, module: str, qualname: str) -> list[tuple[str, str]]:
        """The class a method belongs to (or `qualname` itself, a class) and its bases defined under hybridrl/,
        nearest first."""
        parts = qualname.split(".")
        for cut in range(len(parts), 0, -1):
            key = (module, ".".join(parts[:cut]))
            if isinstance(self.scopes.get(key), ast.ClassDef):
                chain, todo = [], [key]
                while todo:
                    cls = todo.pop(0)
                    chain.append(cls)
                    todo += [self.unique[base] for base in self.bases.get(cls, []) if base in self.unique
                             and isinstance(self.scopes.get(self.unique[base]), ast.ClassDef)]
                return chain
        return []

    # ---- where a value's config path comes from
    def _seed(self) -> None:
        """Parameters annotated with a schema class, or documented as a section in their function's docstring."""
        for (module, qualname), node in self.scopes.items():
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                name = arg.annotation and ast.unparse(arg.annotation).strip("'\"").rsplit(".", 1)[-1]
                if name in self.class_path:
                    self.bound[(module, qualname, arg.arg)].add(self.class_path[name])
                elif name in self.unique and isinstance(self.scopes.get(self.unique[name]), ast.ClassDef):
                    self.bound[(module, qualname, arg.arg)].add(OBJECT + ":".join(self.unique[name]))
            for name, path in re.findall(r"(\w+): the `([\w.]+)` section", ast.get_docstring(node) or ""):
                if path in self.nodes:
                    self.bound[(module, qualname, name)].add(path)

    def _lookup(self, module: str, qualname: str, name: str) -> set[str]:
        """A name's paths in its function (or an enclosing one); `self.x` in the method's class or its bases."""
        if name.startswith("self."):
            return set().union(*(self.bound.get((cls_module, cls, name), set())
                                 for cls_module, cls in self._classes_of(module, qualname)))
        parts = qualname.split(".")
        for cut in range(len(parts), 0, -1):
            paths = self.bound.get((module, ".".join(parts[:cut]), name))
            if paths:
                return paths
        return set()

    def resolve(self, node: ast.AST, module: str, qualname: str) -> set[str]:
        """The config paths an expression's value has (empty: not a config value, or one the scan cannot follow)."""
        if isinstance(node, ast.Name):
            if node.id in SELF:
                classes = self._classes_of(module, qualname)
                return {f"{OBJECT}{classes[0][0]}:{classes[0][1]}"} if classes else set()
            return self._lookup(module, qualname, node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id in SELF:
                return self._lookup(module, qualname, f"self.{node.attr}")
            return self._child(self.resolve(node.value, module, qualname), node.attr)
        if isinstance(node, ast.Subscript):
            return self._child(self.resolve(node.value, module, qualname), *self._key(node.slice, module, qualname))
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
                return self._child(self.resolve(node.args[0], module, qualname),
                                   *self._key(node.args[1], module, qualname))
            if isinstance(func, ast.Attribute) and func.attr == "get":
                return self._child(self.resolve(func.value, module, qualname),
                                   *self._key(node.args[0], module, qualname))
        if isinstance(node, (ast.BoolOp, ast.IfExp)):
            parts = node.values if isinstance(node, ast.BoolOp) else [node.body, node.orelse]
            return set().union(*(self.resolve(part, module, qualname) for part in parts))
        return set()

    def _key(self, node: ast.AST, module: str, qualname: str) -> set[str]:
        """The key names an index or getattr argument stands for: a string, or a parameter called with strings."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return {node.value}
        if isinstance(node, ast.Name):
            return self.keys.get((module, qualname, node.id), set())
        return set()

    def _child(self, paths: set[str], *names: str) -> set[str]:
        """The paths `name` reaches from `paths`: a field of a config section, or an attribute an object of a class
        under hybridrl/ was given (`trainer.config` with trainer a RayPPOTrainer)."""
        children = set()
        for path in paths:
            for name in names:
                if path.startswith(OBJECT):
                    children |= self._lookup(*path[len(OBJECT):].split(":"), f"self.{name}")
                elif join(path, name) in self.nodes and is_config_class(self.nodes[path]):
                    children.add(join(path, name))
        return children

    # ---- values flowing into names, attributes and the parameters of calls
    def _propagate(self, module: str, qualname: str, function: ast.AST) -> None:
        for node in self._own_nodes(function):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                             and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                    for name_node, value in pairs:
                        self._bind_target(module, qualname, name_node, self.resolve(value, module, qualname))
            elif isinstance(node, ast.Call):
                self._bind_call(module, qualname, node)
            elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                    and isinstance(node.iter, ast.Name) and node.iter.id in self.constants[module]:
                self.keys[(module, qualname, node.target.id)] |= self.constants[module][node.iter.id]

    def _bind_target(self, module: str, qualname: str, target: ast.AST, paths: set[str]) -> None:
        if not paths:
            return
        if isinstance(target, ast.Name):
            self.bound[(module, qualname, target.id)] |= paths
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in SELF:
            classes = self._classes_of(module, qualname)
            if classes:
                self.bound[(*classes[0], f"self.{target.attr}")] |= paths

    def _bind_call(self, module: str, qualname: str, call: ast.Call) -> None:
        func, args = call.func, list(call.args)
        if isinstance(func, ast.Name) and func.id == "RayClassWithInitArgs" and args:
            func, args = args[0], args[1:]  # the worker class, built with the remaining arguments
        elif isinstance(func, ast.Attribute) and func.attr == "remote":  # X.remote(...), X.options(...).remote(...)
            func = func.value.func.value if isinstance(func.value, ast.Call) \
                and isinstance(func.value.func, ast.Attribute) else func.value
        callee = self._callee(module, qualname, func)
        if callee is None:
            return
        callee_module, callee_name, target = callee
        params = target.args.posonlyargs + target.args.args
        if params and params[0].arg in ("self", "cls"):
            params = params[1:]
        names = {arg.arg for arg in target.args.posonlyargs + target.args.args + target.args.kwonlyargs}
        passed = [(param.arg, arg) for param, arg in zip(params, args) if not isinstance(arg, ast.Starred)]
        passed += [(keyword.arg, keyword.value) for keyword in call.keywords if keyword.arg in names]
        for name, value in passed:
            key = (callee_module, callee_name, name)
            self.bound[key] |= self.resolve(value, module, qualname)
            self.keys[key] |= self._key(value, module, qualname) - {None}

    def _callee(self, module: str, qualname: str, func: ast.AST):
        """(module, qualname, function node) of what a call runs: a function or class (its __init__) defined once
        under hybridrl/, or a method of the caller's own class (`self.method`)."""
        place = None
        if isinstance(func, ast.Name):
            own = (module, func.id)
            place = own if own in self.scopes else self.unique.get(func.id)
        elif isinstance(func, ast.Attribute) and (isinstance(func.value, ast.Name) and func.value.id in SELF
                                                  or _is_super(func.value)):
            classes = self._classes_of(module, qualname)
            for cls_module, cls in classes[1:] if _is_super(func.value) else classes:
                if isinstance(self.scopes.get((cls_module, f"{cls}.{func.attr}")), ast.FunctionDef):
                    place = (cls_module, f"{cls}.{func.attr}")
                    break
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
                and not self._lookup(module, qualname, func.value.id):
            owner = self.unique.get(func.value.id)
            if owner is not None and isinstance(self.scopes.get(owner), ast.ClassDef):  # Class.method(...)
                place = (owner[0], f"{owner[1]}.{func.attr}")
            else:  # module.function(...)
                place = self.unique.get(func.attr)
        node = place and self.scopes.get(place)
        if isinstance(node, ast.ClassDef):
            place = (place[0], f"{place[1]}.__init__")
            node = self.scopes.get(place)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        return (*place, node)


def _is_super(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def _string_collections(tree: ast.Module) -> dict[str, set[str]]:
    """The module's top-level names bound to a tuple, list or set of strings, or a dict with string keys: a loop
    over one (`for hook in HOOKS: config.get(hook)`) reads each of them."""
    collections = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
            node.target if isinstance(node, ast.AnnAssign) else None
        value = getattr(node, "value", None)
        items = value.keys if isinstance(value, ast.Dict) else \
            value.elts if isinstance(value, (ast.Tuple, ast.List, ast.Set)) else None
        if isinstance(target, ast.Name) and items and all(isinstance(item, ast.Constant)
                                                          and isinstance(item.value, str) for item in items):
            collections[target.id] = {item.value for item in items}
    return collections


def code_sources() -> dict[str, str]:
    """The code that uses the config: hybridrl/ outside hybridrl/config/, hybridrl/compat/ and the subsystems'
    config_checks.py (checks read values to judge them, not to use them; compat/ holds verl's names for verl's
    callers, which would make ours defined twice), plus the config classes' own methods."""
    return {str(path.relative_to(HYBRIDRL)): path.read_text() for path in sorted(HYBRIDRL.rglob("*.py"))
            if (path.relative_to(HYBRIDRL).parts[0] != "config" or path.name == "schema.py")
            and path.relative_to(HYBRIDRL).parts[0] != "compat" and path.name != "config_checks.py"}


def refused_keys() -> set[str]:
    return (set(validation.NOT_IMPLEMENTED) | set(validation.DEPRECATED) | set(validation.SET_ELSEWHERE)
            | set(validation.SAME_AS) | set(validation.ALIASES))


def unread_keys(root: type, sources: dict[str, str], refused: set[str], roots=None) -> list[str]:
    read = ConfigReads(root, sources, ROOTS if roots is None else roots).read
    return [key for key in schema_keys(root) if key not in refused and key not in read]


def test_every_schema_key_is_read_or_refused():
    assert unread_keys(schema.PPOConfig, code_sources(), refused_keys()) == []


def test_every_sft_config_key_is_read():
    """The SFT trainer's schema (hybridrl/trainer/main_sft.py) under the same rule; it refuses no key."""
    assert unread_keys(main_sft.SFTConfig, code_sources(), set()) == []


def test_every_refused_key_is_a_schema_key():
    """A stale entry (a key renamed or removed from the schema) would refuse nothing. A verl name may sit inside a
    free dict the schema has as one key (reward_model.reward_kwargs.overlong_buffer_cfg.len); its target may not."""
    keys = set(schema_keys(schema.PPOConfig))
    in_free_dict = {key for key in validation.ALIASES if any(key.startswith(f"{leaf}.") for leaf in keys)}
    assert refused_keys() - keys - in_free_dict == set()
    assert {target for target, _ in validation.ALIASES.values()} - keys == set()


def test_every_roots_entry_names_a_function_or_class_and_a_path():
    """A stale entry (code renamed or moved) would bind nothing, and the keys only it followed would look unread."""
    reads = ConfigReads(schema.PPOConfig, code_sources(), {})
    nodes = {"", *schema_nodes(schema.PPOConfig), *schema_nodes(main_sft.SFTConfig)}
    assert [(module, scope) for module, scope, _ in ROOTS if (module, scope) not in reads.scopes] == []
    assert [path for path in ROOTS.values() if path not in nodes] == []


# ---- the audit itself, on code written for it

@dataclasses.dataclass
class _Model:
    path: str
    external_lib: str


@dataclasses.dataclass
class _Reward:
    model: _Model
    budget: int


@dataclasses.dataclass
class _Root:
    policy: _Model
    reward: _Reward
    refused_leaf: bool
    read_by_get: str


ANNOTATED = """
def main(config: _Root):
    use(config.policy.path, config.get("read_by_get"))  # config.reward.budget in a comment reads nothing
"""


@pytest.mark.parametrize("refused, expected", [
    (set(), ["policy.external_lib", "reward.model.path", "reward.model.external_lib", "reward.budget",
             "refused_leaf"]),
    ({"refused_leaf"}, ["policy.external_lib", "reward.model.path", "reward.model.external_lib", "reward.budget"])])
def test_the_audit_catches_a_key_nobody_reads(refused, expected):
    assert unread_keys(_Root, {"main.py": ANNOTATED}, refused, roots={}) == expected


def test_the_audit_reads_full_paths_not_last_names():
    """`model.external_lib` read on the policy's model does not read the reward model's; an access on a value the
    scan cannot follow reads nothing."""
    code = """
def main(config: _Root):
    load(config.policy)

def load(model):
    return model.path, model.external_lib

def unknown(thing):
    return thing.budget, thing.model.path
"""
    assert unread_keys(_Root, {"main.py": code}, set(), roots={}) == [
        "reward.model.path", "reward.model.external_lib", "reward.budget", "refused_leaf", "read_by_get"]


def test_the_audit_follows_workers_built_with_a_section_and_documented_or_listed_roots():
    """A class built with a section keeps it as self.config for every method (here through RayClassWithInitArgs and
    a subclass); a parameter documented as a section, and a ROOTS entry, give their values a path."""
    code = """
def spawn(config: _Root):
    RayClassWithInitArgs(RewardWorker, config.reward, seed=0)

class RewardWorker:
    def __init__(self, config, seed=0):
        self.config = config

class ProbedWorker(RewardWorker):
    def forward(self):
        rm = self.config
        return rm.budget, getattr(rm.model, "path")

def documented(settings):
    \"\"\"settings: the `policy` section.\"\"\"
    return settings["path"]

class Plugin:
    def run(self):
        return self.cfg.reward.model.external_lib, self.cfg.read_by_get
"""
    roots = {("main.py", "Plugin", "self.cfg"): ""}
    assert unread_keys(_Root, {"main.py": code}, set(), roots=roots) == ["policy.external_lib", "refused_leaf"]
