"""Shared fixtures: tiny random mlx-lm llama models saved as MLX dirs with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import build_tiny_gguf, make_tiny_model


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
