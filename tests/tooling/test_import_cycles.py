"""The scripts import one another without a cycle: a module imported
halfway through its own import sees its names missing, and a cycle hidden
in a function-level import only breaks when that function first runs."""

from __future__ import annotations

import ast
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports anywhere: at the top, in
    a function, under `if TYPE_CHECKING:`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {n.split(".")[0] for n in names} & modules
    return found


def import_graph(scripts: Path = SCRIPTS) -> dict[str, set[str]]:
    """Module -> the modules it imports, among the files in `scripts`."""
    files = {p.stem: p for p in scripts.glob("*.py")}
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
    assert len(graph) > 10 and graph["run_tests"], graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    (tmp_path / "a.py").write_text("import b\nimport json\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("import a as alias\n")
    (tmp_path / "d.py").write_text("import a\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
