"""The package layout: public names and Hydra targets resolve, no subpackage imports upwards, the architecture
page (``docs/architecture.md``) pictures the layers as the subpackages declare them and its table lists exactly the
files that exist, and every named note that is referenced exists."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import yaml
from hydra.utils import get_object

import lightning_zero

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_zero"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def test_every_public_name_imports():
    assert lightning_zero.__all__, "lightning_zero.__all__ is empty"
    for name in lightning_zero.__all__:
        assert getattr(lightning_zero, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from lightning_zero import *", namespace)
    assert set(lightning_zero.__all__) <= namespace.keys()


def _targets(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["_target_"]] if "_target_" in node else []
        return found + [t for value in node.values() for t in _targets(value)]
    if isinstance(node, list):
        return [t for value in node for t in _targets(value)]
    return []


def test_every_hydra_target_resolves():
    targets = {
        (path.relative_to(ROOT), target)
        for path in sorted((ROOT / "conf").rglob("*.yaml"))
        for target in _targets(yaml.safe_load(path.read_text()))
    }
    assert len(targets) >= 6, targets  # strategies, data, trainer, the report callback, the SLURM launcher
    for path, target in targets:
        assert callable(get_object(target)), f"{path}: _target_ {target!r} does not resolve to a callable"


def _allowed_imports(subpackage: str) -> set[str]:
    """The subpackages named on the ``May import:`` line of the subpackage's docstring (always itself)."""
    doc = ast.get_docstring(ast.parse((PACKAGE / subpackage / "__init__.py").read_text())) or ""
    match = re.search(r"^May import: (.+?)(?:\n\n|\Z)", doc, flags=re.MULTILINE | re.DOTALL)
    assert match, f"lightning_zero/{subpackage}/__init__.py does not say what it may import ('May import: ...')"
    named = re.findall(r"lightning_zero\.(\w+)", match.group(1))
    return {subpackage, "compat", *named}  # compat.py: torch's and Lightning's private APIs, for everyone


def _imported_parts(path: Path) -> set[str]:
    """The subpackage of every ``lightning_zero`` import in ``path`` (``comm`` for ``lightning_zero.comm.x``)."""
    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        for module in modules:
            if module == "lightning_zero" or module.startswith("lightning_zero."):
                parts.add(module.split(".")[1] if "." in module else "")
    return parts


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_no_subpackage_imports_upwards(subpackage):
    allowed = _allowed_imports(subpackage)
    for path in sorted((PACKAGE / subpackage).rglob("*.py")):
        parts = {"config" if p == "config_checks" else p for p in _imported_parts(path)}  # config's own checks
        bad = parts - allowed
        assert not bad, f"{path.relative_to(ROOT)} imports lightning_zero.{sorted(bad)}; allowed: {sorted(allowed)}"


# config.py runs its checks (config_checks.py), which import nothing of the package.
@pytest.mark.parametrize(
    ("module", "allowed"), [("config.py", {"config_checks"}), ("compat.py", set()), ("config_checks.py", set())]
)
def test_config_and_compat_import_nothing_of_the_package(module, allowed):
    assert _imported_parts(PACKAGE / module) <= allowed


@pytest.mark.parametrize("subpackage", SUBPACKAGES)
def test_every_subpackage_says_what_it_owns(subpackage):
    doc = ast.get_docstring(ast.parse((PACKAGE / subpackage / "__init__.py").read_text())) or ""
    named = set(re.findall(r"``(\w+)``", doc))
    files = {p.stem for p in (PACKAGE / subpackage).glob("*.py") if p.stem != "__init__"}
    assert not files - named, f"lightning_zero/{subpackage}/__init__.py does not say what {sorted(files - named)} own"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports. Every import counts, wherever it is: at
    the top, inside a function, or under ``TYPE_CHECKING`` (a type-only import still means that one file cannot be
    read without the other, and becomes a runtime circle the day the annotation is evaluated)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package of this module, level - 1 packages up
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                # `from lightning_zero.x import y` imports the module y when it is one, else a name of x
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # `import lightning_zero.x.y` as a name of a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    for start in sorted(graph):
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(start, iter(sorted(graph[start])))]
        if start in done:
            continue
        path.append(start)
        on_path.add(start)
        while stack:
            node, edges = stack[-1]
            following = next(edges, None)
            if following is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif following in on_path:
                return [*path[path.index(following) :], following]
            elif following not in done:
                stack.append((following, iter(sorted(graph[following]))))
                path.append(following)
                on_path.add(following)
    return None


def test_no_module_imports_in_a_circle():
    graph = _module_graph()
    assert len(graph) > 100, "the package's modules were not found"
    assert "lightning_zero.engine.model_sharding" in graph["lightning_zero.trainer.strategy"], "imports not read"
    cycle = _find_cycle(graph)
    assert cycle is None, f"modules importing each other in a circle: {' -> '.join(cycle)}"


def test_the_cycle_finder_finds_circles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_the_front_doors_never_import_each_other():
    graph = _module_graph()
    for door, other in (("trainer", "fabric"), ("fabric", "trainer")):
        assert other not in _allowed_imports(door), f"lightning_zero/{door}/ may import lightning_zero/{other}/"
        for module, imported in graph.items():
            if module.startswith(f"lightning_zero.{door}"):
                sideways = sorted(m for m in imported if m.startswith(f"lightning_zero.{other}"))
                assert not sideways, f"{module} imports {sideways}: the front doors stand side by side on the engine"


def test_the_layers_have_no_cycle():
    # Declared permissions alone must form a hierarchy, so no future import can close a loop between subpackages.
    graph = {sub: _allowed_imports(sub) - {sub} - {"config", "compat"} for sub in SUBPACKAGES}
    order: list[str] = []
    while graph:
        ready = sorted(sub for sub, needs in graph.items() if needs <= set(order))
        assert ready, f"the subpackages' 'May import' lines form a cycle among {sorted(graph)}"
        order += ready
        for sub in ready:
            del graph[sub]


def _architecture_paths() -> set[str]:
    table = ARCHITECTURE.read_text().split("## Which file owns what", 1)[1].split("\n## ", 1)[0]
    paths: set[str] = set()
    for row in table.splitlines():
        if not row.startswith("| `lightning_zero/"):
            continue
        cell = row.split("|")[1]
        names = re.findall(r"`([^`]+)`", cell)
        first = names[0]
        paths.add(first)
        folder = first.rsplit("/", 1)[0]
        paths.update(f"{folder}/{name}" for name in names[1:])  # "`models/mlp.py`, `param_groups.py`"
    return paths


def test_architecture_table_lists_exactly_what_exists():
    existing = {f"lightning_zero/{sub}/" for sub in SUBPACKAGES}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and path.parent != PACKAGE:
            continue  # a subpackage's row stands for its __init__
        existing.add(relative)
    listed = _architecture_paths()
    page = ARCHITECTURE.relative_to(ROOT)
    assert not existing - listed, f"missing from the table of {page}: {sorted(existing - listed)}"
    assert not listed - existing, f"listed in the table of {page} but absent: {sorted(listed - existing)}"


def test_architecture_picture_puts_every_subpackage_above_what_it_may_import():
    picture = ARCHITECTURE.read_text().split("```text\n", 1)[1].split("```", 1)[0]
    line_of: dict[str, int] = {}
    for number, line in enumerate(picture.splitlines()):
        for name in re.findall(r"(?:^|\s{2,})(\w+)/\s", line):  # a layer, not a word of a description
            assert name not in line_of, f"{name}/ drawn twice in the picture of {ARCHITECTURE.name}"
            line_of[name] = number
    assert sorted(line_of) == SUBPACKAGES, f"the picture draws {sorted(line_of)}, the package has {SUBPACKAGES}"
    for sub in SUBPACKAGES:
        above = sorted(dep for dep in _allowed_imports(sub) - {sub, "config", "compat"} if line_of[dep] <= line_of[sub])
        assert not above, f"{sub}/ may import {above}, which the picture draws beside or above it"


def test_every_referenced_note_exists():
    sources = [
        *PACKAGE.rglob("*.py"),
        ROOT / "README.md",
        *(ROOT / "docs").rglob("*.md"),
        *(ROOT / "benchmarks").glob("*.py"),
        ROOT / "benchmarks/README.md",
    ]
    sources += list((ROOT / "tests").glob("*.py"))
    defined: dict[str, list[str]] = {}
    referenced: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        for line in path.read_text().splitlines():
            # A note is defined by a line holding only its name, in a docstring or as a comment heading.
            match = re.fullmatch(r"\s*(?:# )?Note \[([^\]]+)\]\s*", line)
            if match:
                defined.setdefault(match.group(1), []).append(path.relative_to(ROOT).as_posix())
    for path in sources:
        if path == Path(__file__):
            continue
        for raw in re.findall(r"Note \[([^\]]{1,120})\]", path.read_text()):
            # A name may wrap onto the next line of a comment or of an implicitly concatenated string.
            name = " ".join(re.sub(r'"\s*\n\s*"|\n\s*#?', " ", raw).split())
            referenced.setdefault(name, path.relative_to(ROOT).as_posix())
    assert len(defined) >= 15, sorted(defined)
    twice = {name: where for name, where in defined.items() if len(where) > 1}
    assert not twice, f"notes defined more than once: {twice}"
    dangling = {name: where for name, where in referenced.items() if name not in defined}
    assert not dangling, f"references to notes that do not exist: {dangling}"


def test_python_m_commands_resolve():
    main = importlib.import_module("lightning_zero.__main__")
    for command, module in main._COMMANDS.items():
        assert callable(importlib.import_module(module).main), command
