"""Auto against target-only as a user meets it (issue 65: "at least 0.97x target-only from a
fresh home, warm-up included"): each prompt its own `specmlx run` process, from a fresh
$SPECMLX_HOME, a warm-up run first (it pays the first pass-cost probe), for each checkout given
and each condition (quiet, or beside `python -c "while 1: pass"` on another core).

    . scripts/env.sh && .venv/bin/python experiments/first_runs.py --pair cpu-demo-target \\
        cpu-distilled-draft --prompts experiments/sets/code6.jsonl --limit 4 -n 40 \\
        [--rev 8adf1f8] [--conditions quiet,busy]

Per checkout and condition it prints, for target-only (-k 0, no draft) and for the default
(-k auto, --tree as given: auto by default): the seconds of each process from start to exit (loading included), the
decode tok/s pooled over the prompts (each process's tokens over its decode seconds: what the
probe costs is not in it), and auto's ratio to target-only on both, with the warm-up run and
without it. Every auto output is checked against target-only's (greedy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ap = argparse.ArgumentParser()
ap.add_argument("--pair", nargs=2, metavar=("TARGET", "DRAFT"), required=True)
ap.add_argument("--prompts", default=str(ROOT / "experiments/sets/code6.jsonl"))
ap.add_argument("--limit", type=int, default=4)
ap.add_argument("-n", type=int, default=40)
ap.add_argument("--rev", default=None, help="an earlier revision to run beside this checkout")
ap.add_argument("--conditions", default="quiet")
ap.add_argument("--tree", default="auto", help="auto's --tree (off, auto, N)")
a = ap.parse_args()
rows = [json.loads(line) for line in open(a.prompts) if line.strip()]
prompts = [r["prompt"] for r in rows[: a.limit + 1]]  # the first is the warm-up's
target, draft = a.pair


def one(tree: Path, home: str, prompt: str, auto: bool) -> tuple[float, dict]:
    """(seconds from start to exit, the run's --json) of one `specmlx run` process."""
    args = (
        ["--draft", draft, "-k", "auto", "--tree", a.tree]
        if auto
        else ["--draft", "none", "-k", "0"]
    )
    env = {**os.environ, "SPECMLX_HOME": home, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "specmlx", "run", "--target", target, *args, "-n", str(a.n),
           "--json", prompt]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd="/tmp", capture_output=True, text=True, check=True)
    return time.perf_counter() - t0, json.loads(out.stdout)


def series(tree: Path, auto: bool) -> list[tuple[float, dict]]:
    """The warm-up run, then one process a prompt, in one fresh home (the models' own files
    stay where they are: only what specmlx learns starts afresh)."""
    with tempfile.TemporaryDirectory() as home:
        for name in ("cpu-demo", "cpu-distilled", "cpu-eagle3", "wheels"):
            src = Path(os.environ.get("SPECMLX_HOME", "~/.cache/specmlx")).expanduser() / name
            if src.exists():
                os.symlink(src, Path(home) / name)
        return [one(tree, home, p, auto) for p in prompts]


def pooled(runs: list[tuple[float, dict]]) -> float:
    stats = [r["stats"] for _, r in runs]
    return sum(s["generated"] for s in stats) / sum(s["decode_s"] for s in stats)


trees = ([("rev " + a.rev, None)] if a.rev else []) + [("here", ROOT)]
work = Path(tempfile.mkdtemp())
for cond in a.conditions.split(","):
    for label, tree in trees:
        if tree is None:  # the earlier revision, checked out beside this one
            tree = work / a.rev
            if not tree.exists():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                                str(tree), a.rev], check=True)  # fmt: skip
        busy = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if cond == "busy" else None
        try:
            plain, auto = series(tree, False), series(tree, True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        for (_, p), (_, q) in zip(plain, auto, strict=True):
            if p["tokens"] != q["tokens"]:
                raise SystemExit(f"{label}: auto's output differs from target-only's")
        wall = lambda runs: sum(t for t, _ in runs)  # noqa: E731
        print(
            f"{cond:5s} {label:12s}: seconds a process, target-only "
            f"{' '.join(f'{t:.1f}' for t, _ in plain)}; auto "
            f"{' '.join(f'{t:.1f}' for t, _ in auto)} ({auto[-1][1]['stats']['auto']['from']})"
        )
        print(f"{cond:5s} {label:12s}: auto / target-only, wall with warm-up "
              f"{wall(plain) / wall(auto):.2f}x, without {wall(plain[1:]) / wall(auto[1:]):.2f}x; "
              f"decode tok/s {pooled(auto):.2f} against {pooled(plain):.2f} "
              f"({pooled(auto) / pooled(plain):.2f}x)", flush=True)  # fmt: skip
if a.rev:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                    str(work / a.rev)], check=False)  # fmt: skip
