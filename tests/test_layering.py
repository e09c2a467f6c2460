"""The layers' dependencies point one way (``docs/architecture.md``), read from the sources with ``ast``
(nothing is imported): the core never imports ``gradcomp.hooks`` or ``gradcomp.experiments``, nor names
one of their modules in a string (a module imported by name, as a fork server's preload list does);
``gradcomp/compressors/`` imports nothing of gradcomp but itself and the neutral utilities, which
import nothing of gradcomp but each other; the hooks never import the experiments; and nothing imports
the folders ``hooks/`` and ``experiments/`` by their own names, only as ``gradcomp.hooks`` and
``gradcomp.experiments``.

Imports are every ``import`` and ``from ... import`` statement, inside functions and ``TYPE_CHECKING``
blocks too, relative ones resolved, and every ``importlib.import_module("...")`` or
``__import__("...")`` of a literal name.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "gradcomp": ROOT / "gradcomp",
    "gradcomp.hooks": ROOT / "hooks",
    "gradcomp.experiments": ROOT / "experiments",
}
"""Each package and its folder (``gradcomp/hooks`` and ``gradcomp/experiments`` are links to the
top-level folders, not followed: each module is read once, under its package's name)."""
UPPER = ("gradcomp.hooks", "gradcomp.experiments")
"""The layers above the core."""
UTILITIES = ("gradcomp.host", "gradcomp.flat", "gradcomp.options", "gradcomp.workspace")
"""What the compressors may use of the rest of gradcomp: neutral utilities, which know no layer."""
FOLDERS = ("hooks", "experiments")
"""Top-level folders that are packages of gradcomp's, never imported by their own names."""
UPPER_NAME = re.compile(r"gradcomp\.(hooks|experiments)(\.\w+)*")
"""A string that is an upper layer's module name (prose that mentions one is for a reader)."""


class Import(NamedTuple):
    module: str
    """The module imported (for ``from a import b``: ``a.b`` where that is a module, else ``a``)."""
    where: str
    """``path:line``."""
    by_name: bool = False
    """Only a string that names the module (for whatever imports it by that name)."""


def modules() -> dict[str, Path]:
    """Every module of gradcomp's packages by name (a package by its own name, for its ``__init__``)."""
    found = {}
    for package, folder in PACKAGES.items():
        for directory, subdirectories, files in os.walk(folder):  # links are not followed
            subdirectories[:] = sorted(d for d in subdirectories if d != "__pycache__")
            parts = Path(directory).relative_to(folder).parts
            for file in files:
                if file.endswith(".py"):
                    stem = () if file == "__init__.py" else (file[:-3],)
                    found[".".join((package, *parts, *stem))] = Path(directory) / file
    return found


MODULES = modules()


def imports(path: Path, module: str, known: set[str]) -> Iterator[Import]:
    """What the source at ``path`` (the module ``module``) imports or names; ``known``: the modules there are."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    imported_by_call: set[int] = set()
    for node in ast.walk(tree):  # a call comes before its arguments
        where = f"{shown}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            yield from (Import(alias.name, where) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield Import(full if full in known else base, where)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if function in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                imported_by_call.add(id(node.args[0]))
                yield Import(node.args[0].value, where)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and UPPER_NAME.fullmatch(node.value)
            and id(node) not in imported_by_call  # (read above, as the import it is)
        ):
            yield Import(node.value, where, by_name=True)


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def violations(sources: dict[str, Path]) -> list[str]:
    """Every import in ``sources`` (module name -> path) that breaks a rule of the layering."""
    known = set(MODULES) | set(sources)
    found = []
    for module, path in sorted(sources.items()):
        for imported in imports(path, module, known):
            name, where = imported.module, imported.where
            if within(module, "gradcomp") and not within(module, *UPPER) and within(name, *UPPER):
                how = "names" if imported.by_name else "imports"
                found.append(f"{where}: the core ({module}) {how} {name}, a layer above it")
            if imported.by_name:
                continue
            compressor = within(module, "gradcomp.compressors")
            if compressor and within(name, "gradcomp") and not within(name, "gradcomp.compressors", *UTILITIES):
                found.append(f"{where}: {module} imports {name}: a compressor uses gradcomp's utilities only")
            if within(module, *UTILITIES) and within(name, "gradcomp") and not within(name, *UTILITIES):
                found.append(f"{where}: {module} imports {name}: a neutral utility imports no layer")
            if within(module, "gradcomp.hooks") and within(name, "gradcomp.experiments"):
                found.append(f"{where}: {module} imports {name}: the hooks never import the experiments")
            if within(name, *FOLDERS):
                found.append(f"{where}: {module} imports {name}: import it as gradcomp.{name}")
    return found


def test_the_layers_depend_one_way() -> None:
    sources = dict(MODULES)
    for folder in ("tests", "examples"):  # outside gradcomp: only the rule about the folders' own names applies
        for path in (ROOT / folder).rglob("*.py"):
            sources[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    found = violations(sources)
    assert not found, "\n".join(found)


def test_every_module_is_read() -> None:
    """The walk finds the layers (and no module twice through the links), and the reading finds imports."""
    assert {"gradcomp.engine.spec", "gradcomp.hooks.ddp", "gradcomp.experiments.training.run"} <= set(MODULES)
    assert not any(name.startswith(("gradcomp.hooks.hooks", "gradcomp.experiments.experiments")) for name in MODULES)
    assert not any(within(name, "gradcomp.gradcomp") for name in MODULES)
    read = {i.module for i in imports(MODULES["gradcomp.hooks"], "gradcomp.hooks", set(MODULES))}
    assert {"gradcomp.launch", "gradcomp.engine.spec", "gradcomp.hooks.auto", "torch"} <= read


VIOLATIONS = {
    "gradcomp.launch": ("def f() -> None:\n    import gradcomp.hooks.ddp\n", "the core (gradcomp.launch) imports"),
    "gradcomp.engine.x": ("from gradcomp import hooks\n", "imports gradcomp.hooks, a layer above"),
    "gradcomp.cost.x": ("import importlib\nimportlib.import_module('gradcomp.experiments.sweep')\n", "imports"),
    "gradcomp.sync.x": ("PRELOAD = ['torch', 'gradcomp.experiments.training']\n", "names gradcomp.experiments"),
    "gradcomp.compressors.x": ("from ..engine import spec\n", "imports gradcomp.engine.spec: a compressor"),
    "gradcomp.compressors.y": ("from gradcomp.collectives import api\n", "a compressor uses"),
    "gradcomp.options": ("from gradcomp.compressors import REGISTRY\n", "a neutral utility imports no layer"),
    "gradcomp.hooks.x": ("from gradcomp.experiments.training import run\n", "the hooks never import"),
    "gradcomp.experiments.x": ("import hooks.ddp\n", "imports hooks.ddp: import it as gradcomp.hooks.ddp"),
}
ALLOWED = {
    "gradcomp.compressors.z": "from gradcomp import host\nfrom gradcomp.options import convert\n",
    "gradcomp.engine.z": '"""See gradcomp.hooks.make."""\nX = "attach it with gradcomp.hooks.register"\n',
}


def test_a_violation_of_each_rule_is_found(tmp_path: Path) -> None:
    for name, (text, message) in VIOLATIONS.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        found = violations({name: path})
        assert len(found) == 1 and message in found[0], (name, found)
    for name, text in ALLOWED.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        assert violations({name: path}) == [], name
