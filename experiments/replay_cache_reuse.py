"""Replay llama.vim editing a real file against `specmlx serve --cache-reuse 0` and
`--cache-reuse N` in one run: the time from each pause's request to its suggestion, the
prompt tokens prefilled and taken from the cache, and whether the two servers suggested the
same text. Both servers are up for the whole run and take each pause in turn (the order
alternating), one at a time, so load from elsewhere falls on both alike.

The session is experiments/replay_llamavim.py's: the cursor walks down a source file two lines
a pause, half a line typed; llama.vim's default sizes (256 lines before the cursor, 64
after, n_predict 128), a ring of two 64-line chunks of another file that drops its first
chunk every other pause (with a warm-up, as the plugin sends one when its ring changes);
each suggestion's follow-up (the position after accepting it) is sent before the next
pause. The window before the cursor slides with it, so without moving cached runs only the
ring comes from the cache.

The model is SmolLM2-135M-Instruct (the registry's smollm2-135m, float32), its weights as
they are, with three of its unused special tokens (<jupyter_start>, <jupyter_text>,
<jupyter_code>) renamed <fim_prefix>, <fim_suffix>, <fim_middle> so that /infill takes it:
SmolLM2 was not trained to fill in the middle, so its suggestions are poor code, but each
token costs what the real model's does. No draft model (the prompt cache is what is
measured). The servers run from a worktree of --rev, so the figures belong to a commit.

    . scripts/env.sh && .venv/bin/python experiments/replay_cache_reuse.py --reuse 256
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
vim = importlib.import_module("replay_llamavim")

RENAMED = {"<jupyter_start>": "<fim_prefix>", "<jupyter_text>": "<fim_suffix>",
           "<jupyter_code>": "<fim_middle>"}  # fmt: skip


def smollm2_fim(out: Path) -> Path:
    """SmolLM2-135M in float32 with FIM token names (see the module's docstring)."""
    if (out / "config.json").exists():
        return out
    import mlx.core as mx
    from mlx_lm.utils import load_tokenizer, save_config, save_model

    from specmlx.decoding.fim import fim_template
    from specmlx.models.loading import load_model
    from specmlx.models.registry import load_registry

    base = load_model(load_registry().resolve("smollm2-135m"))
    base.model.set_dtype(mx.float32)
    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, base.model)
    save_config({**asdict(base.model.args), "eos_token_id": base.tokenizer.eos_token_id},
                tmp / "config.json")  # fmt: skip
    base.tokenizer.save_pretrained(str(tmp))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (tmp / name).read_text()
        for old, new in RENAMED.items():  # (the config lists no added tokens in newer saves)
            assert name != "tokenizer.json" or f'"{old}"' in text, old
            text = text.replace(f'"{old}"', f'"{new}"')
        (tmp / name).write_text(text)
    tokenizer = load_tokenizer(tmp)
    assert fim_template(tokenizer) is not None, "the renamed tokens are not FIM tokens"
    tmp.rename(out)
    return out


def worktree(rev: str) -> tuple[Path, str]:
    """A worktree of ``rev`` under /tmp (made once) and its short hash."""
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev],
                           capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    tree = Path(f"/tmp/specmlx-reuse-{short}")
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), short],
                       check=True, capture_output=True)  # fmt: skip
    return tree, short


def same_text(a: str | None, b: str | None) -> bool:
    """Whether two greedy suggestions agree as far as both go (t_max_predict_ms cuts each
    at its own time)."""
    if a is None or b is None:
        return False
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def pause(url: str, p: dict, timeout: float, debounce: float, typing: float) -> dict:
    """One pause as llama.vim makes it (replay_llamavim.replay's, one pause), after
    ``typing`` seconds of the user typing: its warm-up when the ring changed (not waited
    for), the debounce, the suggestion, its follow-up; the warm-up's answer is waited for
    before the other server's turn. (The typing time puts this server's last answer more
    than the quarter second behind, after which a warm-up runs at once, for both servers
    alike.)"""
    time.sleep(typing)
    warm = None
    if p["ring_changed"]:
        warm = threading.Thread(target=vim.post, args=(url, vim.warm_up(p), timeout))
        warm.start()
    time.sleep(debounce)
    first_s, first = vim.post(url, vim.fim(p, 250), timeout)
    row = {"first_s": first_s, "starved": first is None}
    if first is not None and "content" in first:
        row.update(predicted=first.get("timings/predicted_n"), cached=first.get("tokens_cached"),
                   prompt_n=first.get("timings/prompt_n"), content=first["content"])  # fmt: skip
        second_s, second = vim.post(url, vim.fim(p, 1000, p["prompt"] + first["content"]), timeout)
        row.update(second_s=second_s, second_starved=second is None)
    elif first is not None:
        row["error"] = first.get("status")
    if warm is not None:
        warm.join(timeout)
    return row


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--reuse", type=int, default=256, help="--cache-reuse of the second server")
    a.add_argument("--rev", default="HEAD", help="the commit both servers run")
    a.add_argument("--file", default=shutil.__file__, help="the file being edited")
    a.add_argument("--extra", default=os.__file__, help="the ring's other file")
    a.add_argument("--start-line", type=int, default=300)
    a.add_argument("--pauses", type=int, default=8)
    a.add_argument("--timeout", type=float, default=300.0)
    a.add_argument("--debounce", type=float, default=0.3)
    a.add_argument("--typing", type=float, default=1.0, help="seconds typed before a pause")
    a.add_argument("--context", type=int, default=8192)
    a.add_argument("--model", default="/tmp/specmlx-smollm2-135m-fim")
    a.add_argument("--json", dest="json_out")
    args = a.parse_args()
    model = smollm2_fim(Path(args.model))
    tree, rev = worktree(args.rev)
    pauses = vim.session(Path(args.file), Path(args.extra), args.pauses, args.start_line)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECMLX_SERVER")}
    env["PYTHONPATH"] = str(tree)
    models = ["--target", str(model), "--draft", "none", "--context", str(args.context)]
    servers = {}
    try:
        for reuse in (0, args.reuse):
            extra = ["--cache-reuse", str(reuse)]
            servers[reuse] = vim.start_server([sys.executable], env, models, extra)
        load = os.getloadavg()[0]
        results = {reuse: [] for reuse in servers}
        for i, p in enumerate(pauses):
            for reuse in sorted(servers, reverse=i % 2 == 1):  # ABBA: neither always first
                row = pause(servers[reuse][1], p, args.timeout, args.debounce, args.typing)
                results[reuse].append(row)
                print(json.dumps({"pause": i, "cache_reuse": reuse, **row}), flush=True)
        load = (load, os.getloadavg()[0])
    finally:
        for server, _ in servers.values():
            server.terminate()
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()

    def column(rows, key):
        return [r[key] for r in rows if r.get(key) is not None]

    before, after = results[0], results[args.reuse]
    agree = sum(
        same_text(x.get("content"), y.get("content")) for x, y in zip(before, after, strict=True)
    )
    moved = Path(args.file).name
    print(f"\n{args.pauses} pauses in {moved} from line {args.start_line} (two lines a pause), "
          f"ring from {Path(args.extra).name}; SmolLM2-135M (FIM names), no draft, context "
          f"{args.context}, at {rev}; {platform.machine()}, {os.cpu_count()} cores, load "
          f"average {load[0]:.1f} at the start, {load[1]:.1f} at the end\n")  # fmt: skip
    print("| server | suggestion p50 | mean | max | prompt tokens prefilled (mean) | "
          "from the cache (mean) | starved |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for reuse, rows in results.items():
        firsts = [r["first_s"] for r in rows]
        print(f"| --cache-reuse {reuse} | {statistics.median(firsts):.2f} s | "
              f"{statistics.mean(firsts):.2f} s | {max(firsts):.2f} s | "
              f"{statistics.mean(column(rows, 'prompt_n') or [0]):.0f} | "
              f"{statistics.mean(column(rows, 'cached') or [0]):.0f} | "
              f"{sum(r['starved'] for r in rows)} |")  # fmt: skip
    print(f"\n| pause | ring changed | --cache-reuse 0 | --cache-reuse {args.reuse} | "
          "prefilled, 0 | prefilled, N | same text |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for i, (x, y) in enumerate(zip(before, after, strict=True)):
        print(f"| {i} | {'yes' if pauses[i]['ring_changed'] else ''} | {x['first_s']:.1f} s | "
              f"{y['first_s']:.1f} s | {x.get('prompt_n')} | {y.get('prompt_n')} | "
              f"{'yes' if same_text(x.get('content'), y.get('content')) else 'no'} |")  # fmt: skip
    p50 = [statistics.median([r["first_s"] for r in rows]) for rows in (before, after)]
    print(
        f"\np50 --cache-reuse {args.reuse} / --cache-reuse 0: {p50[1] / p50[0]:.2f}x; "
        f"the same suggestion (as far as both go) at {agree} of {len(before)} pauses"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
