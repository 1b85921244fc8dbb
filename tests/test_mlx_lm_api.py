"""The mlx-lm internals specmlx relies on are where it expects them, and the installed mlx
and mlx-lm are inside the ranges pyproject.toml declares (the ranges CI tests). When mlx-lm
moves something, this fails by name instead of a generation failing somewhere later."""

from __future__ import annotations

import importlib
import inspect
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from specmlx.core import mlx_lm_api
from specmlx.core.recurrent import LAYOUTS, RECURRENCES

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def _declared() -> dict[str, Requirement]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    return {r.name: r for r in reqs if r.marker is None or r.marker.evaluate()}


@pytest.mark.parametrize("name", ["mlx", "mlx-lm"])
def test_the_installed_version_is_in_the_declared_range(name):
    req = _declared()[name]
    assert req.specifier, f"{name} is declared without a range"
    assert re.search(r"<\d", str(req.specifier)), f"{name} has no ceiling"
    assert req.specifier.contains(version(name)), (name, version(name), str(req.specifier))


def test_the_private_calls_exist_with_the_expected_signatures():
    from mlx_lm import utils

    assert list(inspect.signature(utils._get_classes).parameters) == ["config"]
    assert not [
        p
        for p in inspect.signature(utils.maybe_set_recommended_wired_limit).parameters.values()
        if p.default is inspect.Parameter.empty
    ]
    model, args = mlx_lm_api.model_classes({"model_type": "llama"})
    assert model.__name__ == "Model" and args.__name__ == "ModelArgs"
    with pytest.raises((ValueError, KeyError)):
        mlx_lm_api.model_classes({"model_type": "no-such-architecture"})


@pytest.mark.parametrize("module", sorted(LAYOUTS))
def test_each_recorded_recurrence_is_where_the_recorder_patches_it(module):
    fn = getattr(importlib.import_module(module), LAYOUTS[module])
    params = inspect.signature(fn).parameters
    for arg in (*RECURRENCES[LAYOUTS[module]], "state"):
        assert arg in params, (module, LAYOUTS[module], arg, list(params))
