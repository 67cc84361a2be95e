"""The layers of the house as a specification (docs/architecture.md, "Layers"): every import inside `zoo`
points down or stays in its own layer, and the imports between its modules form no cycle.

Every import counts: at the top of a module, inside a function (a lazy import), under `if TYPE_CHECKING:`
(a type's dependency is a dependency), `from zoo import x` (the package root, the top of the house: inside
the package, import the module itself), relative imports, a package's `__init__` run by importing one of its
modules, and `importlib.import_module` of a literal name or of a module-level table of names (`zoo.rl`'s lazy
exports). The scanner reads the source (AST), so it sees lazy imports that running the code would not.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top. A module may import its own unit, any unit of its own layer (the cycle test keeps those
# imports acyclic) and any unit of a lower layer; never a higher one. "zoo" is the package root.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("version", "config", "trust", "weights", "batch", "task_names", "fingerprint", "publishing",
     "command_line", "host_memory"),
    ("media", "world"),
    ("tokenizers",),
    ("models",),
    ("parallel", "expert_parallel", "meta_init", "registry", "hub", "init_from", "float8_experts"),
    ("datamodules",),
    ("analysis", "pretokenize", "inference", "evaluation"),
    ("tasks",),
    ("rl",),
    ("zoo",),
    ("serve",),
    ("cli",),
)


@dataclass(frozen=True)
class Import:
    """`importer` imports `target` (both module names) at `line`; `how`: top, lazy, type-checking, init."""

    importer: str
    target: str
    line: int
    how: str

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}, {self.how}) imports {self.target}"


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((root / "zoo").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _marked(tree: ast.AST, outer: type | tuple[type, ...], test: str | None = None) -> set[int]:
    """ids of the nodes inside functions (or inside `if TYPE_CHECKING:` bodies, with `test`)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, outer) and (test is None or test in ast.unparse(node.test)):
            for statement in node.body:
                inside |= {id(n) for n in ast.walk(statement)}
    return inside


def _named_targets(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The dotted names one import statement or `import_module` call reads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source == "zoo":  # `from zoo import x` reads the package root, whatever x is
            return ["zoo"]
        return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
    return []


def _dynamic_targets(tree: ast.Module) -> list[tuple[str, int]]:
    """Literal names given to `import_module`, directly or through a module-level dict of names."""
    tables = {
        target.id: [v.value for v in node.value.values if isinstance(v, ast.Constant)]
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name != "import_module":
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.append((arg.value, node.lineno))
        elif isinstance(arg, ast.Subscript) and isinstance(arg.value, ast.Name) and arg.value.id in tables:
            found += [(value, node.lineno) for value in tables[arg.value.id] if isinstance(value, str)]
    return found


def imports(root: Path) -> list[Import]:
    """Every import between two modules of the package under `root` (module docstring)."""
    known = modules(root)
    found: list[Import] = []
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        lazy = _marked(tree, (ast.FunctionDef, ast.AsyncFunctionDef))
        typing_only = _marked(tree, ast.If, "TYPE_CHECKING")
        named = [
            (target, node.lineno, node)
            for node in ast.walk(tree)
            for target in _named_targets(node, module, path.name == "__init__.py", known)
        ]
        named += [(target, line, None) for target, line in _dynamic_targets(tree)]
        for target, line, node in named:
            if target.split(".")[0] != "zoo":
                continue
            if node is None:
                how = "import_module"
            else:
                how = "type-checking" if id(node) in typing_only else "lazy" if id(node) in lazy else "top"
            while target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target != module:
                found.append(Import(module, target, line, how))
            # Importing zoo.a.b runs zoo/a/__init__.py first (the root's runs for every module alike).
            parts = target.split(".")
            for depth in range(2, len(parts)):
                package = ".".join(parts[:depth])
                if not (module == package or module.startswith(package + ".")):
                    found.append(Import(module, package, line, f"{how}, its package's __init__"))
    return list(dict.fromkeys(found))  # one statement importing two names of one module is one import


def unit(module: str) -> str:
    """The part of the package a module belongs to: `zoo.models.moe` -> `models`; the root -> `zoo`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "zoo"


def layer_of(layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    return {name: level for level, names in enumerate(layers) for name in names}


def upward_imports(found: list[Import], layers: tuple[tuple[str, ...], ...]) -> list[str]:
    level = layer_of(layers)
    return [
        f"{i}: layer {level[unit(i.target)]} ({unit(i.target)}) is above layer {level[unit(i.importer)]} "
        f"({unit(i.importer)})"
        for i in found
        if unit(i.importer) != unit(i.target) and level[unit(i.target)] > level[unit(i.importer)]
    ]


def cycles(found: list[Import]) -> list[list[Import]]:
    """One cycle per strongly connected component of the import graph, as the imports that make it."""
    graph: dict[str, dict[str, Import]] = {}
    for i in found:
        graph.setdefault(i.importer, {}).setdefault(i.target, i)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(graph, set(c), min(c)) for c in components]


def _cycle_through(graph: dict[str, dict[str, Import]], members: set[str], start: str) -> list[Import]:
    """A shortest path of imports from `start` back to itself inside one component (breadth first)."""
    paths: dict[str, list[Import]] = {start: []}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ, edge in sorted(graph.get(node, {}).items()):
                if succ == start:
                    return [*paths[node], edge]
                if succ in members and succ not in paths:
                    paths[succ] = [*paths[node], edge]
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in a component but on no cycle")


# --- the zoo -------------------------------------------------------------------------------------------


def test_every_part_of_the_package_has_exactly_one_layer():
    units = {unit(m) for m in modules(ROOT)}
    listed = [name for names in LAYERS for name in names]
    assert sorted(set(listed)) == sorted(listed), "a unit is listed in two layers"
    assert units - set(listed) == set(), "give every new module or package a layer (and docs/architecture.md)"
    assert set(listed) - units == set(), "a layer names a unit that no longer exists"


def test_no_module_imports_a_higher_layer():
    assert upward_imports(imports(ROOT), LAYERS) == []


def test_the_modules_import_each_other_without_a_cycle():
    found = cycles(imports(ROOT))
    assert [" -> ".join(str(i) for i in cycle) for cycle in found] == []


# --- the scanner finds what it must --------------------------------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"zoo/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


SMALL_LAYERS = (("batch",), ("models",), ("tasks",), ("zoo",))


def test_the_scanner_sees_lazy_type_checking_relative_and_root_imports_that_point_up(tmp_path: Path):
    root = write_package(tmp_path, {
        "zoo/batch.py": "def f():\n    from zoo.models.net import Net\n",
        "zoo/models/__init__.py": "",
        "zoo/models/net.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..tasks.train import Task\n"
        ),
        "zoo/models/head.py": "from zoo import batch\n",
        "zoo/tasks/__init__.py": "",
        "zoo/tasks/train.py": "from zoo.models import net\nimport zoo.batch\n",
    })  # fmt: skip
    found = upward_imports(imports(root), SMALL_LAYERS)
    lazy = "zoo.batch (line 2, lazy) imports zoo.models.net"
    assert found[0] == f"{lazy}: layer 1 (models) is above layer 0 (batch)"
    assert "zoo.batch (line 2, lazy, its package's __init__) imports zoo.models" in found[1]
    assert any("zoo.models.net (line 3, type-checking) imports zoo.tasks.train" in f for f in found)
    assert any("zoo.models.head (line 1, top) imports zoo: layer 3" in f for f in found)
    assert len(found) == 5  # and zoo.models.net's type-checking import runs zoo/tasks/__init__.py


def test_the_scanner_names_the_imports_of_a_cycle_through_a_package_init_and_lazy_exports(tmp_path: Path):
    root = write_package(tmp_path, {
        "zoo/models/__init__.py": "from zoo.models.net import Net\n",
        "zoo/models/net.py": "def f():\n    from zoo.models.head import Head\n",
        "zoo/models/head.py": "from zoo.models.net import Net\n",
        "zoo/tasks/__init__.py": (
            "from importlib import import_module\n_EXPORTS = {'T': 'zoo.tasks.train'}\n"
            "def __getattr__(name):\n    return import_module(_EXPORTS[name])\n"
        ),
        "zoo/tasks/train.py": "import zoo.tasks\n",
        "zoo/batch.py": "import zoo.models.net\n",
    })  # fmt: skip
    found = {frozenset(i.importer for i in cycle): [str(i) for i in cycle] for cycle in cycles(imports(root))}
    models = frozenset({"zoo.models.net", "zoo.models.head"})
    tasks = frozenset({"zoo.tasks", "zoo.tasks.train"})
    assert set(found) == {models, tasks}
    assert found[models] == [
        "zoo.models.head (line 1, top) imports zoo.models.net",
        "zoo.models.net (line 2, lazy) imports zoo.models.head",
    ]
    assert found[tasks] == [
        "zoo.tasks (line 4, import_module) imports zoo.tasks.train",
        "zoo.tasks.train (line 1, top) imports zoo.tasks",
    ]
    # zoo.batch importing zoo.models.net runs zoo/models/__init__.py: an import of `zoo.models` too.
    assert Import("zoo.batch", "zoo.models", 1, "top, its package's __init__") in imports(root)


def test_imports_inside_one_layer_and_downward_ones_are_allowed(tmp_path: Path):
    root = write_package(tmp_path, {
        "zoo/batch.py": "",
        "zoo/models/__init__.py": "",
        "zoo/models/net.py": "from zoo.batch import X\nfrom . import head\n",
        "zoo/models/head.py": "",
        "zoo/tasks/__init__.py": "",
        "zoo/tasks/train.py": "from zoo.models.net import Net\n",
    })  # fmt: skip
    assert upward_imports(imports(root), SMALL_LAYERS) == []
    assert cycles(imports(root)) == []
