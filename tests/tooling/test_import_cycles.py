"""The scripts import one another without a cycle, and each job's package
imports only the layers below it: a module imported halfway through its own
import sees its names missing, and a cycle hidden in a function-level import
only breaks when that function first runs. docs/architecture.md's table and
diagram of the imports are checked against them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
ARCHITECTURE = SCRIPTS.parent / "docs" / "architecture.md"
# A row of the page's import table: | `keep.apply` | `keep.fetch` | `cli`, ... |
ROW = r"(?m)^\| `((?:lib|keep|prove|ship)\.\w+)` \| (.*) \| (.*) \|$"
# What each package may import (docs/architecture.md): the shared library at
# the bottom, then keep the series, prove it, ship it.
MAY_IMPORT = {
    "lib": {"lib"},
    "keep": {"lib", "keep"},
    "prove": {"lib", "keep", "prove"},
    "ship": {"lib", "keep", "prove", "ship"},
}


def module_name(path: Path, root: Path) -> str:
    """scripts/keep/apply.py -> keep.apply; scripts/keep/__init__.py -> keep."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports anywhere: at the top, in
    a function, under `if TYPE_CHECKING:`; `from keep import apply` is an
    import of keep.apply."""

    def longest(name: str) -> str | None:
        parts = name.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in modules:
                return ".".join(parts[:n])
        return None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {m for m in map(longest, names) if m}
    return found


def import_graph(scripts: Path = SCRIPTS) -> dict[str, set[str]]:
    """Module -> the modules it imports, among the files below `scripts`."""
    files = {module_name(p, scripts): p for p in scripts.rglob("*.py")}
    return {name: imports_of(p, set(files)) for name, p in sorted(files.items())}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, ..., a], or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt, [*path, node])
            if cycle:
                return cycle
        done.add(node)
        return None

    for start in graph:
        cycle = visit(start, [])
        if cycle:
            return cycle
    return None


def test_the_scripts_import_one_another_without_a_cycle():
    graph = import_graph()
    assert len(graph) > 40 and graph["prove.run_tests"], graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_is_in_a_job_and_imports_only_the_layers_below():
    graph = import_graph()
    loose = sorted(m for m in graph if m.split(".")[0] not in MAY_IMPORT)
    assert not loose, f"modules outside lib/, keep/, prove/ and ship/: {loose}"
    upward = sorted(
        f"{m} -> {n}"
        for m, imported in graph.items()
        for n in imported
        if n.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]
    )
    assert not upward, "imports of a layer above: " + ", ".join(upward)


def test_the_architecture_page_shows_the_imports():
    """docs/architecture.md's table is every module's imports, and its
    diagram's solid arrows are exactly the imports between the jobs' modules."""
    graph = {m: deps for m, deps in import_graph().items() if "." in m}
    page = ARCHITECTURE.read_text()
    table = {}
    for m, jobs, lib in re.findall(ROW, page):
        table[m] = set(re.findall(r"`([\w.]+)`", jobs)) | {
            f"lib.{n}" for n in re.findall(r"`(\w+)`", lib)
        }
    assert table == graph, "docs/architecture.md's import table differs"
    diagram = page[page.index("```mermaid") :]
    diagram = diagram[: diagram.index("\n```\n")]
    arrows = set(re.findall(r"(?m)^\s*(\w+) --> (\w+)$", diagram))
    imports = {
        (m.split(".")[1], n.split(".")[1])
        for m, deps in graph.items()
        for n in deps
        if not n.startswith("lib.")
    }
    assert arrows == imports, (
        f"arrows not imported: {sorted(arrows - imports)}; "
        f"imports with no arrow: {sorted(imports - arrows)}"
    )


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    (tmp_path / "a.py").write_text("import b\nimport json\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("import a as alias\n")
    (tmp_path / "d.py").write_text("import a\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_imports_from_a_package_are_found(tmp_path):
    for pkg in ("lib", "keep"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "lib" / "paths.py").write_text("import json\n")
    (tmp_path / "keep" / "apply.py").write_text(
        "from lib.paths import ROOT\nfrom keep import fetch\n"
    )
    (tmp_path / "keep" / "fetch.py").write_text("def f():\n    import keep.apply\n")
    graph = import_graph(tmp_path)
    assert graph["keep.apply"] == {"lib.paths", "keep.fetch"}
    assert graph["keep.fetch"] == {"keep.apply"}
    assert graph["lib"] == graph["keep"] == graph["lib.paths"] == set()
    assert find_cycle(graph) == ["keep.apply", "keep.fetch", "keep.apply"]
