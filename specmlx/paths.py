"""Where specmlx keeps state on disk, and the one way it writes a file there (a leaf module).

State files (probes, adaptive-k state, built models' metadata) are read by concurrent runs and
server requests, so every write goes to a unique temporary file in the same directory and is
then renamed over the target: a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

Warn = Callable[[str], None]


def specmlx_home() -> Path:
    """Where specmlx keeps its caches ($SPECMLX_HOME, default ~/.cache/specmlx)."""
    return Path(os.environ.get("SPECMLX_HOME") or "~/.cache/specmlx").expanduser()


def expand_path(text: str) -> Path:
    """Expand ~ and $VARS in ``text``; $SPECMLX_HOME falls back to its default."""
    env = {**os.environ, "SPECMLX_HOME": str(specmlx_home())}
    expanded = re.sub(
        r"\$(\w+)|\$\{(\w+)\}",
        lambda m: env.get(m.group(1) or m.group(2), m.group(0)),
        text,
    )
    return Path(expanded).expanduser()


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` atomically: a unique temp file beside it, then os.replace.

    Two writers at once each rename a complete file of their own; the last one wins.
    Raises OSError (read-only or full disk): callers that can live without the file use
    ``save_json``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def save_json(path: Path, data: dict, warn: Warn | None = None) -> bool:
    """Best-effort state write: True when saved; on OSError (a read-only home, a full disk)
    ``warn`` gets one line and the caller carries on without the file."""
    try:
        atomic_write(path, json.dumps(data))
        return True
    except OSError as e:
        if warn is not None:
            warn(f"could not save {path.name} under {path.parent} ({e.strerror or e}); continuing")
        return False


def load_json(path: Path) -> dict | None:
    """A JSON object from ``path``, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
