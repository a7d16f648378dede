"""The C++ sources keep the shape docs/architecture.md draws.

The layer table in docs/architecture.md lists ``csrc/`` folders from the
c10d face down to ``common/``; "includes point down the table". These tests
read that table and every ``#include "..."`` under ``csrc/`` and fail on
- an include that points up the table (or a folder the table does not name),
- an include loop between modules, a module being a header and the sources of
  the same stem (``Foo.hpp`` + ``Foo.cpp``): two modules that include each
  other cannot be read, built or replaced one at a time.
``csrc/python/`` (bindings, the top) may include any layer. Each failure
names the files, so the fix is either the code or the map.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SOURCES = (".hpp", ".h", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _table_order() -> list[str]:
    """The ``csrc/`` folders of the architecture's layer table, top first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = re.findall(r"^\| `csrc/([a-z_]+)/` \|", text, re.MULTILINE)
    assert folders, "docs/architecture.md has no layer table rows `csrc/<folder>/`"
    return [f for f in folders if f != "python"]  # the bindings sit above every layer


def _module(path: Path) -> str:
    return str(path.relative_to(CSRC).with_suffix(""))


def _includes() -> dict[str, set[tuple[str, str]]]:
    """Module -> {(included module, 'file: line')} for includes of our own files."""
    graph: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in sorted(CSRC.rglob("*")):
        if path.suffix not in SOURCES:
            continue
        text = path.read_text()
        for match in INCLUDE.finditer(text):
            target = CSRC / match.group(1)
            if not target.exists():
                continue  # torch's, the standard library's, a generated header
            line = text.count("\n", 0, match.start()) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            if _module(target) != _module(path):
                graph[_module(path)].add((_module(target), where))
    return graph


def test_every_csrc_folder_is_on_the_map() -> None:
    order = _table_order()
    folders = sorted(p.name for p in CSRC.iterdir() if p.is_dir() and p.name != "python")
    missing = [f for f in folders if f not in order]
    assert not missing, f"csrc/ folders missing from docs/architecture.md's layer table: {missing}"


def test_includes_point_down_the_layer_table() -> None:
    order = _table_order()
    level = {folder: i for i, folder in enumerate(order)}
    graph = _includes()
    assert sum(len(v) for v in graph.values()) > 50, "found too few includes to judge"
    upward = []
    for module, targets in graph.items():
        source = module.split("/")[0]
        if source == "python":
            continue
        for target, where in targets:
            dest = target.split("/")[0]
            if dest != source and level.get(dest, -1) <= level.get(source, len(order)):
                upward.append(f"{where}: csrc/{source}/ includes {target} (csrc/{dest}/)")
    assert not upward, "includes that point up docs/architecture.md's table:\n" + "\n".join(
        sorted(upward)
    )


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_loop() -> None:
    # The finder itself, on a graph with one loop of three and a tail.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_include_loops_between_modules() -> None:
    graph = _includes()
    plain = {m: {t for t, _ in targets} for m, targets in graph.items()}
    loops = _cycles(plain)
    detail = []
    for loop in loops:
        members = set(loop)
        for m in loop:
            detail += [f"  {where}: {m} -> {t}" for t, where in graph[m] if t in members]
    assert not loops, f"include loops: {loops}\n" + "\n".join(sorted(detail))


def _subclasses(base: str) -> set[str]:
    """Classes under csrc/ declared as deriving publicly from ``base``."""
    pattern = re.compile(r"class\s+(\w+)\s*(?:final\s*)?:\s*public\s+" + re.escape(base) + r"\b")
    found: set[str] = set()
    for path in CSRC.rglob("*.hpp"):
        found.update(pattern.findall(path.read_text()))
    return found


def test_one_c10d_face_and_every_cpu_route_behind_the_route_interface() -> None:
    """``XcommBackend`` is xcomm's one c10d backend; every way a group's ops
    run is a ``Route``, and what routes are built on (Gloo and NCCL as they
    are, or the C++-only program's store collectives) is an ``InnerRoute``."""
    assert _subclasses("c10d::Backend") == {"XcommBackend"}
    assert _subclasses("InnerRoute") == {"RawRoute", "StoreRoute"}
    routes = _subclasses("Route") | _subclasses("ShmRouteBase") | _subclasses("InnerRoute")
    assert routes == {
        "InnerRoute",
        "RawRoute",
        "StoreRoute",
        "CheckedRoute",
        "ShmRouteBase",
        "ShmRoute",
        "HierarchicalRoute",
    }, routes
