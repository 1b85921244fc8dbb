"""The package's shape: every import inside specmlx points down (no cycles, lazy imports
included), and the leaf modules import nothing of specmlx."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specmlx"
LEAVES = {"errors", "stats", "paths", "machine"}


def imports() -> dict[str, set[str]]:
    """module -> the specmlx modules it imports anywhere in its body."""
    mods = {p.stem: p for p in PACKAGE.glob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specmlx."):
                names = [node.module.split(".", 1)[1]]
            elif isinstance(node, ast.Import):
                names = [
                    a.name.split(".", 1)[1] for a in node.names if a.name.startswith("specmlx.")
                ]
            else:
                continue
            graph[m] |= {n.split(".")[0] for n in names if n and n.split(".")[0] in mods}
    return graph


def test_imports_form_no_cycle():
    graph, order, state = imports(), [], {}

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == "done":
            return
        assert state.get(m) != "open", "import cycle: " + " -> ".join(path + [m])
        state[m] = "open"
        for dep in sorted(graph[m]):
            visit(dep, path + [m])
        state[m] = "done"
        order.append(m)

    for m in sorted(graph):
        visit(m, [])
    assert len(order) == len(graph)


def test_leaf_modules_import_nothing_of_specmlx():
    graph = imports()
    for leaf in LEAVES:
        assert graph[leaf] <= {"__init__"}, (leaf, graph[leaf])


def test_the_engine_knows_nothing_of_the_layers_above():
    graph = imports()
    above = {"cli", "display", "bench", "loading", "registry", "sources", "footprint", "stream"}
    above |= {"session", "worker", "serve", "client", "overhead"}
    assert not graph["engine"] & above, graph["engine"]
