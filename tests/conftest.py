"""Shared fixtures: tiny random mlx-lm llama models saved as MLX dirs with a real tokenizer;
and ``--quick``, the fast tier (`scripts/test --quick`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the processes tests start import no torch (no_torch/sitecustomize.py); this one (and each
# pytest worker, which inherits the variable) keeps it for the reference code
NO_TORCH = str(Path(__file__).parent / "no_torch")
if NO_TORCH not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [NO_TORCH, os.environ.get("PYTHONPATH")])
    )
if "torch" in sys.modules and sys.modules["torch"] is None:
    del sys.modules["torch"]

import pytest  # noqa: E402
from helpers import build_tiny_gguf, make_tiny_model  # noqa: E402

# the fast tier: the acceptance math, rollback and the cursor, the engine and the batch,
# trees, the session, moved caches, every pair of features together, one server in process
QUICK = {
    "test_acceptance", "test_tree_acceptance", "test_tree_pass", "test_cursor", "test_parts",
    "test_engine", "test_batch", "test_batcher", "test_trees", "test_session",
    "test_cache_reuse", "test_combinations", "test_serve_faults", "test_layout",
    "test_choosers", "test_fitting",
}  # fmt: skip


def pytest_addoption(parser):
    parser.addoption(
        "--quick", action="store_true", help="the fast tier only (conftest.QUICK; no real model)"
    )


# the modules whose tests take longest (scripts/test's --durations): run first, so that the
# workers finish together on short tests instead of one waiting on a long one at the end
SLOW_FIRST = ["test_drafter_kinds", "test_distributed", "test_distribution", "test_real",
              "test_families", "test_editor_session", "test_serve"]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--quick"):
        rank = {m: i for i, m in enumerate(SLOW_FIRST)}
        items.sort(key=lambda i: rank.get(i.path.stem, len(rank)))  # (stable: else as found)
        return
    keep = [i for i in items if i.path.stem in QUICK and "slow" not in i.keywords]
    config.hook.pytest_deselected(items=[i for i in items if i not in keep])
    items[:] = keep


@pytest.fixture
def tiny_model_factory(tmp_path):
    """make(name, **options) -> Path of a tiny MLX model dir under tmp_path."""
    return lambda name="tiny", **kw: make_tiny_model(tmp_path / name, **kw)


@pytest.fixture
def tiny_model(tiny_model_factory) -> Path:
    return tiny_model_factory()


@pytest.fixture
def specmlx_home(tmp_path, monkeypatch) -> Path:
    """An empty $SPECMLX_HOME, and no user/$SPECMLX_MODELS registry overrides."""
    home = tmp_path / "specmlx-home"
    monkeypatch.setenv("SPECMLX_HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SPECMLX_MODELS", raising=False)
    monkeypatch.delenv("SPECMLX_MEMORY_BUDGET", raising=False)
    return home


@pytest.fixture
def tiny_gguf(tmp_path):
    """(path, reference model, meta, tensors) of a tiny llama written as a GGUF file."""
    return build_tiny_gguf(tmp_path)
