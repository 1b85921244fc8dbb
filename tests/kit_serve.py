"""The serve kit: the environment a test's `specmlx serve` (and `specmlx run`) gets, with
its own models.toml, home and config directories, and ``local_json``, `specmlx run --json`
in this process with the same models: the reference a served answer is compared with.
Used by test_serve and test_mtp_fronts."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from specmlx.cli import app


def server_env(root: Path, toml: Path) -> dict:
    """This environment with ``toml`` as the models file and the home and config directories
    under ``root``; no server, API key or memory budget inherited."""
    env = dict(os.environ, SPECMLX_MODELS=str(toml), SPECMLX_HOME=str(root / "home"))
    env["XDG_CONFIG_HOME"] = str(root / "xdg")
    for name in ("SPECMLX_SERVER", "SPECMLX_API_KEY", "SPECMLX_MEMORY_BUDGET"):
        env.pop(name, None)
    return env


def local_json(root: Path, *args: str) -> dict:
    """`specmlx run --json` in this process with the same models: the reference."""
    env = server_env(root, root / "models.toml")
    r = CliRunner().invoke(app, ["run", "--json", "-q", *args], env=env)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)
