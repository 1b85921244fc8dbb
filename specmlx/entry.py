"""The `specmlx` console script. On Linux it re-execs itself once with OpenBLAS preloaded,
before anything heavy is imported: MLX, mlx-lm and transformers load once, in the final process.
"""

from __future__ import annotations

import os
import sys

from .machine import OPENBLAS, wants_openblas


def main() -> None:
    """Re-exec with LD_PRELOAD=OpenBLAS when ``wants_openblas``; then run the typer app."""
    env = os.environ
    if wants_openblas(env):
        preload = " ".join(filter(None, [OPENBLAS, env.get("LD_PRELOAD")]))
        argv = [sys.executable, "-m", "specmlx", *sys.argv[1:]]
        os.execve(sys.executable, argv, {**env, "LD_PRELOAD": preload, "SPECMLX_NO_OPENBLAS": "1"})
    from .cli import run_app  # only now: the heavy imports happen in the process that stays

    run_app()
