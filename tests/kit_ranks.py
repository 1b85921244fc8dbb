"""The two-rank kit: `specmlx` run as a subprocess (the way mlx.launch starts the ranks),
the flag that splits the target over two local ranks, and ``same_on_two_ranks``, the check
that a drafter gives the same tokens and rounds with the target split as in one process.
Used by test_distributed and by each head's module (test_eagle3, test_dflash,
test_mtp_fronts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TWO = ["--hosts", "localhost,localhost"]
PROMPT = "def add(a, b):\n    return"


def specmlx(env: dict, *args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specmlx", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        # (a prompt with stdin piped in reads it too: none, unless the test gives input)
        **({} if "input" in kw else {"stdin": subprocess.DEVNULL}),
        **kw,
    )


def tokens(done: subprocess.CompletedProcess) -> list[int]:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["tokens"]


def same_on_two_ranks(tmp_path: Path, target: Path, draft: str, k: int) -> dict:
    """`specmlx run --draft DRAFT` greedy at a fixed k in one process and with the target
    split over two local ranks (the draft, a head, replicated on each): asserts the same
    tokens, and every round drafted and kept alike (so each rank's head read the same, whole,
    hidden states). Returns the one-process run's JSON."""
    env = dict(os.environ, SPECMLX_HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "x"))
    for name in ("SPECMLX_MODELS", "SPECMLX_SERVER", "SPECMLX_MEMORY_BUDGET", "MLX_RANK"):
        env.pop(name, None)
    args = ["run", "--json", "-q", "--target", str(target), "--draft", draft, "--temp", "0",
            "-k", str(k), "-n", "24"]  # fmt: skip
    one = specmlx(env, *args, PROMPT)
    two = specmlx(env, *args, *TWO, PROMPT)
    assert tokens(two) == tokens(one)
    got, want = json.loads(two.stdout), json.loads(one.stdout)
    assert got["ranks"]["size"] == 2 and got["draft"] == want["draft"]
    for key in ("drafted", "accepted", "accept_hist"):
        assert got["stats"][key] == want["stats"][key], key
    return want
