"""Facts about the machine that figures and saved state depend on (a leaf module).

It imports nothing heavy, so the console entry point can use OPENBLAS before MLX loads.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

# Debian's libopenblas0-pthread. The mlx-cpu wheel links a slow reference BLAS; with this
# preloaded, float32 decoding on the CPU is memory-bound as on a Mac. scripts/env.sh reads it.
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def blas_in_use() -> str:
    """Which BLAS serves MLX's CPU matmuls: a preloaded one (LD_PRELOAD, e.g. OpenBLAS) wins
    over the reference BLAS bundled with the mlx-cpu wheel; macOS uses Accelerate."""
    if platform.system() == "Darwin":
        return "Accelerate (macOS)"
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split() if "blas" in p.lower()]
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    if any(p in maps for p in preload):
        return f"{Path(preload[0]).resolve()} (LD_PRELOAD)"
    bundled = sorted(
        {ln.split()[-1] for ln in maps.splitlines() if "mlx_cpu.libs" in ln and "blas" in ln}
    )
    return (
        f"reference BLAS bundled with mlx-cpu ({Path(bundled[0]).name})" if bundled else "unknown"
    )


def version(dist: str) -> str:
    """An installed distribution's version, or "?"."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def machine_id(device: str) -> str:
    """Host, CPU architecture, MLX ``device``, BLAS and MLX version: what a timing depends on."""
    return f"{platform.node()}|{platform.machine()}|{device}|{blas_in_use()}|mlx {version('mlx')}"


def wants_openblas(env: dict[str, str] | os._Environ = os.environ) -> bool:
    """Whether the entry point should re-exec with OpenBLAS preloaded: on Linux, when it is
    installed, not preloaded yet, and not opted out (SPECMLX_NO_OPENBLAS=1)."""
    return (
        sys.platform == "linux"
        and os.path.exists(OPENBLAS)
        and OPENBLAS not in env.get("LD_PRELOAD", "")
        and not env.get("SPECMLX_NO_OPENBLAS")
    )


if __name__ == "__main__":  # scripts/env.sh: the one OpenBLAS path, for the shell
    print(OPENBLAS)
