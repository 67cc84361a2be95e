"""Short class names on the command line and in YAML: `--model UnifiedPretraining`, `--data.help
ShapesDataModule`, `class_path: ElasticSampler`.

jsonargparse resolves a bare class name to the subclass of that name of the argument's base class, but only
among classes already imported, and `zoo` imports a task or a datamodule only when a config names it by its
full path (so that `zoo --help` and every run stay fast). So before parsing, the modules that define the short
names a command uses are imported: the zoo's own source is scanned for `class Name` (text, nothing executed),
and only modules under `zoo.` are ever imported, so the allow-list of `zoo.trust` is untouched (jsonargparse
still checks the full path it resolves a short name to).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

import yaml

PACKAGE_DIR = Path(__file__).resolve().parent.parent
_CLASS = re.compile(r"^class ([A-Z][A-Za-z0-9_]*)\b", re.MULTILINE)
_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*")


@cache
def class_modules() -> dict[str, tuple[str, ...]]:
    """Every class defined at the top of a zoo module: name -> the modules that define it."""
    index: dict[str, list[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        module = ".".join(("zoo", *path.relative_to(PACKAGE_DIR).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        for name in _CLASS.findall(path.read_text(encoding="utf-8")):
            index.setdefault(name, []).append(module)
    return {name: tuple(modules) for name, modules in index.items()}


def _config_class_paths(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "class_path" and isinstance(value, str):
                yield value
            else:
                yield from _config_class_paths(value)
    elif isinstance(node, list):
        for value in node:
            yield from _config_class_paths(value)


def short_names_used(argv: list[str]) -> set[str]:
    """The bare class names among the arguments (`X`, `--flag=X`) and in the `class_path`s of the config
    files that `--config` / `-c` name."""
    names: set[str] = set()
    for i, arg in enumerate(argv):
        value = arg.partition("=")[2] if arg.startswith("--") else arg
        if _NAME.fullmatch(value):
            names.add(value)
        config = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else None
        config = arg.partition("=")[2] if arg.startswith("--config=") else config
        if config and Path(config).is_file():
            try:
                tree = yaml.safe_load(Path(config).read_text(encoding="utf-8"))
            except yaml.YAMLError:
                continue  # jsonargparse reports a broken file itself, naming it
            names.update(p for p in _config_class_paths(tree) if _NAME.fullmatch(p))
    return names


def import_modules_of(names: Iterable[str]) -> list[str]:
    """Import the zoo modules that define these class names (unknown names are left to jsonargparse to
    refuse); returns the modules imported."""
    index = class_modules()
    modules = sorted({module for name in names for module in index.get(name, ())})
    for module in modules:
        importlib.import_module(module)
    return modules
