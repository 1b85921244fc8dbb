"""The package's shape: every import inside specmlx points down (no cycles, lazy imports
included), and the leaf modules import nothing of specmlx."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specmlx"
LEAVES = {"errors", "core.stats", "paths", "machine"}


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name below specmlx: 'engine', 'cli.run', ..."""
    return {
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }


def _targets(node: ast.AST, here: str, is_package: bool) -> list[str]:
    """The dotted names (below specmlx) an import statement in module ``here`` reaches."""
    if isinstance(node, ast.Import):
        return [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("specmlx.")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        mod = node.module or ""
        base = mod.split(".", 1)[1] if mod.startswith("specmlx.") else None
    else:  # relative: up from this module's package
        parts = here.split(".") if here else []
        package = parts if is_package else parts[:-1]
        keep = len(package) - (node.level - 1)
        if keep < 0:
            return []
        base = ".".join(package[:keep] + ([node.module] if node.module else []))
    if base is None:
        return []
    # `from . import bench` names modules; `from .x import y` names x (y may be a module too)
    return [base] + [f"{base}.{a.name}".strip(".") for a in node.names]


def imports(depth: int = 1) -> dict[str, set[str]]:
    """module -> the specmlx modules it imports anywhere in its body (lazy imports included),
    names cut to their first ``depth`` parts: depth 1 sees the cli package as one module."""
    mods = _modules()
    cut = lambda name: ".".join(name.split(".")[:depth])  # noqa: E731
    graph: dict[str, set[str]] = {cut(m): set() for m in mods if m}
    for m, path in mods.items():
        if not m:
            continue
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            found |= {t for t in _targets(node, m, path.name == "__init__.py") if t in mods}
        graph[cut(m)] |= {cut(t) for t in found if cut(t) != cut(m)}
    return graph


@pytest.mark.parametrize("depth", [1, 2])
def test_imports_form_no_cycle(depth):
    graph, order, state = imports(depth), [], {}

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
    graph = imports(2)
    for leaf in LEAVES:
        assert graph[leaf] <= {"__init__"}, (leaf, graph[leaf])


# the folders from the ground up: each imports only what stands below it (the drawing in
# the README's layout table)
LAYERS = [
    {"errors", "paths", "machine", "data"},
    {"core"},  # sampling, acceptance, caches, cursors, stats
    {"drafting"},  # drafters, lookup, heads, adaptive k
    {"models", "distributed"},  # loading, GGUF, registry; ranks
    {"decoding"},  # the round loop, the session, text
    {"serving", "bench", "distill"},
    {"standins"},  # built demo models (distill makes one)
    {"cli"},
    {"entry", "__main__"},
]


def test_each_folder_imports_only_the_layers_below_it():
    graph = imports()
    floor = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    assert set(graph) - {"__init__"} == set(floor), set(graph) ^ set(floor)
    for m, deps in graph.items():
        for d in deps - {"__init__"}:
            assert floor[d] < floor[m] or (floor[d] == floor[m] and d == m), (m, "imports", d)


def test_the_engine_knows_nothing_of_the_layers_above():
    graph = imports(2)
    own = {d for d in graph["decoding.engine"] if d.startswith("decoding.")}
    assert {d.split(".")[0] for d in graph["decoding.engine"]} <= {
        "core",
        "drafting",
        "errors",
        "decoding",
    }
    # the round and its verifiers, what a request asks, its stops, the drafter factory: not
    # the session, stream, FIM
    allowed = {"decode", "stops", "round", "driver", "verifiers", "drafter_factory"}
    assert own <= {f"decoding.{m}" for m in allowed}, own


def test_one_driver_serves_a_lone_request_and_a_batch():
    """The round is written once (round.one_round) and driven once (driver.Driver): a lone
    generation is a Driver of one row over a LoneTarget, a Batch is a Driver; only the
    driver calls the round, and neither builds a round of its own (no acceptance, no
    drafting, no target pass)."""
    from specmlx.decoding.batch import Batch
    from specmlx.decoding.driver import Driver

    graph = imports(2)
    assert issubclass(Batch, Driver)
    for m in ("decoding.engine", "decoding.batch", "serving.batcher"):
        assert "decoding.driver" in graph[m], m
        text = (PACKAGE / (m.replace(".", "/") + ".py")).read_text()
        assert "accept_proposal" not in text and ".propose(" not in text, m
        assert "one_round(" not in text and "TIME_DRAFT_EVERY" not in text, m
    callers = [
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
        if "one_round(" in p.read_text() and p.name != "round.py"
    ]  # fmt: skip
    assert callers == ["decoding/driver.py"], callers


def test_a_chain_is_a_tree_of_one_branch():
    """One verify and one keep serve chains and trees: the target's side of a round has
    verify, queue and keep only, and the round has no tree path of its own."""
    from specmlx.decoding.round import Verifier

    assert {n for n in vars(Verifier) if not n.startswith("_")} == {"verify", "queue", "keep"}
    for m in ("round", "verifiers"):
        text = (PACKAGE / "decoding" / f"{m}.py").read_text()
        assert "def verify_tree" not in text and "def keep_path" not in text, m
        assert "_tree_round" not in text, m


def test_each_setting_is_parsed_once_at_its_edge():
    """k, the tree size, the drafter choice and the lookup kind are parsed where they enter
    (K.of, TreeSize.of, DrafterChoice.of, LookupKind.of: the CLI, an HTTP body, models.toml,
    the bench's options); what the engine, a batch, a session and the server read takes only
    the typed values, and says so for text."""
    from specmlx.bench.data import System
    from specmlx.decoding.batch import Batch
    from specmlx.decoding.decode import Decode
    from specmlx.decoding.session import DrafterChoice, Request
    from specmlx.drafting.choosing.choosers import K
    from specmlx.drafting.choosing.tree_size import TreeSize
    from specmlx.drafting.lookup.kinds import LookupKind
    from specmlx.serving.serve import ServerSettings

    assert Decode(k=K.of("3"), tree=TreeSize.of("auto")).k == K(3)
    for make in (
        lambda: Decode(k=3),
        lambda: Decode(tree="auto"),
        lambda: Request(k="auto"),
        lambda: Request(tree=8),
        lambda: Request(drafter="lookup"),
        lambda: Decode(lookup="ngram"),
        lambda: ServerSettings("m", 64, drafter="none"),
        lambda: ServerSettings("m", 64, lookup="ngram"),
        lambda: System("specmlx", "d", 2),
        lambda: ServerSettings("m", 64, k=3),
        lambda: Batch(None, None, tree="auto"),
    ):
        with pytest.raises(TypeError, match="parsed at its edge"):
            make()
    # only the edges parse: nothing under decoding/, drafting/ or serving/ but the HTTP body
    for folder in ("decoding", "drafting", "serving", "core"):
        for path in (PACKAGE / folder).rglob("*.py"):
            text = path.read_text()
            calls = sum(text.count(f"{kind}.of(") for kind in ("K", "TreeSize", "LookupKind"))
            calls += text.count("DrafterChoice.of(")
            # the HTTP body's num_draft and draft; the bench's systems name their lookup
            edge = 2 * (path.name == "serve.py" and folder == "serving")
            assert calls <= edge, path
    assert str(LookupKind.of("lookup:ngram")) == "lookup:ngram"
    assert str(DrafterChoice.of("model+lookup")) == "model+lookup"


def test_k_names_a_rounds_drafts_and_k_setting_what_was_asked():
    """One meaning per name: a row's setting (a choosers.K, fixed or auto) is ``k_setting``;
    ``k`` is an int, a round's drafts (RoundReport.k, a chooser's answer). Nothing reads a
    row's fields by getattr with a default, which hid a renamed field once (a seeded row's
    trees then read the measured curve)."""
    from dataclasses import fields

    from specmlx.core.stats import RoundReport
    from specmlx.decoding.round import Row

    names = {f.name: f.type for f in fields(Row)}
    assert "k" not in names and names["k_setting"] == "K"
    assert {f.name: f.type for f in fields(RoundReport)}["k"] == "int"
    for path in (PACKAGE / "drafting").rglob("*.py"):
        text = path.read_text()
        assert 'getattr(row, "' not in text and 'getattr(r, "' not in text, path


def test_the_batch_loop_reaches_the_worker_only_through_its_host_interface():
    """batcher.py and follower.py read and call of the worker only what serving.jobs.Host
    declares (typed, in one place); joining.py and warmups.py take what they use, not the
    worker; nothing looks inside the job queue but Jobs itself."""
    from specmlx.serving.jobs import Host

    declared = set(Host.__annotations__) | {n for n in vars(Host) if not n.startswith("_")}
    for name in ("batcher", "follower"):
        tree = ast.parse((PACKAGE / "serving" / f"{name}.py").read_text())
        used = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value  # self.w.X, w.X (w = self.w), worker.X
            if (
                isinstance(v, ast.Attribute)
                and v.attr == "w"
                and getattr(v.value, "id", "") == "self"
            ):
                used.add(node.attr)
            elif isinstance(v, ast.Name) and v.id in ("w", "worker"):
                used.add(node.attr)
        assert used and used <= declared, (name, used - declared)
    for name in ("joining", "warmups", "batcher", "follower"):
        text = (PACKAGE / "serving" / f"{name}.py").read_text()
        assert "queue.mutex" not in text and ".queue.queue" not in text, name
        assert "(worker)" not in text and "(self.w," not in text, name


def test_only_the_models_build_command_imports_the_standins():
    graph = imports(2)
    users = {m for m, deps in graph.items() if any(d.startswith("standins") for d in deps)}
    assert users <= {"cli.models", "standins"}, users
