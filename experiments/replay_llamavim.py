"""Replay llama.vim's request pattern over a scripted edit session against two servers:
the one before issue 26's fixes (git REV, default fcd72f6^) and this checkout's.

The session walks down a source file; at each pause the "editor" has typed part of a line.
As llama.vim does (autoload/llama.vim), it sends a warm-up (/infill with n_predict 0 and
the ring of extra context) whenever the ring changed, not waiting for its answer; then, the
typing debounce later, the FIM request with t_max_predict_ms 250; when that suggestion
arrives, a second FIM request for the position after accepting it (t_max_predict_ms 1000).
The suggestion latency is the first FIM request's wall time. A request not answered within
--timeout seconds is abandoned (the editor has moved on) and counted as starved.

With --beside, the second request is not waited for (llama.vim's speculative request for
the next position runs while the user types on): the next pause's first request runs beside
it, and the two servers are this checkout's, one request at a time (--max-batch 1) and
batched (its default --max-batch): the suggestion latency then shows whether the first
request waits for the second.

The two servers run one after the other (one at a time: a 2-core machine cannot host both
fairly), in one invocation, on the same session. The CPU demo pair cannot infill (SmolLM2
has no FIM tokens): `--target fim-standin --draft none` builds a random-weight FIM model.

    . scripts/env.sh && .venv/bin/python experiments/replay_llamavim.py
    . scripts/env.sh && .venv/bin/python experiments/replay_llamavim.py --beside \
        --target fim-standin --draft none
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
FIELDS = ["content", "timings/predicted_n", "timings/prompt_n", "tokens_cached"]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def session(path: Path, extra_path: Path, pauses: int, start: int) -> list[dict]:
    """The edit session: at pause i the cursor is inside line start + 2i, half of it typed;
    the ring (two 64-line chunks of another file) changes every other pause."""
    lines = path.read_text().splitlines(keepends=True)
    other = extra_path.read_text().splitlines(keepends=True)
    out = []
    for i in range(pauses):
        row = start + 2 * i
        line = lines[row]
        typed = line[: max(1, len(line.rstrip()) // 2)]
        chunks = [other[64 * (i // 2 + j) : 64 * (i // 2 + j + 1)] for j in range(2)]
        out.append(
            {
                "input_prefix": "".join(lines[max(0, row - 256) : row]),
                "prompt": typed,
                "input_suffix": line[len(typed) :] + "".join(lines[row + 1 : row + 65]),
                "input_extra": [
                    {"filename": extra_path.name, "text": "".join(c)} for c in chunks if c
                ],
                "ring_changed": i % 2 == 0,
            }
        )
    return out


def fim(p: dict, t_max_predict_ms: int, prompt: str | None = None) -> dict:
    return {
        "id_slot": 0, "input_prefix": p["input_prefix"], "input_suffix": p["input_suffix"],
        "input_extra": p["input_extra"], "prompt": p["prompt"] if prompt is None else prompt,
        "n_predict": 128, "n_indent": 0, "top_k": 40, "top_p": 0.99, "stream": False,
        "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
        "t_max_prompt_ms": 500, "t_max_predict_ms": t_max_predict_ms, "response_fields": FIELDS,
    }  # fmt: skip


def warm_up(p: dict) -> dict:
    return {
        "input_extra": p["input_extra"], "n_predict": 0, "samplers": [], "cache_prompt": True,
        "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""],
    }  # fmt: skip


def post(url: str, body: dict, timeout: float) -> tuple[float, dict | None]:
    """(seconds, JSON body) of one request, or (timeout, None) when it was abandoned."""
    t = time.perf_counter()
    try:
        r = httpx.post(url + "/infill", json=body, timeout=timeout)
        if r.status_code != 200:
            return time.perf_counter() - t, {"status": r.status_code, "error": r.text[:300]}
        return time.perf_counter() - t, r.json()
    except httpx.TimeoutException:
        return timeout, None


def fim_standin(root: Path, text: str) -> Path:
    """A random-weight llama with a FIM tokenizer (SmolLM2, behind the CPU demo pair, has no
    fill-in-the-middle tokens, so /infill refuses it): 8 blocks of 768, slow enough on a
    2-core CPU for queueing to show. Its suggestions are noise; only the server's
    scheduling is measured."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import save_tiny, tiny_config, tiny_tokenizer

    if not (root / "config.json").exists():
        tok = tiny_tokenizer([text], vocab_size=2000, fim=True)
        config = tiny_config(len(tok), hidden_size=768, intermediate_size=2048,
                             num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4)  # fmt: skip
        save_tiny(root, config, tok, seed=0)
    return root


def start_server(
    python: list[str], env: dict, models: list[str], extra: list[str] = ()
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        *python,
        "-m",
        "specmlx",
        "serve",
        "-q",
        "--port",
        str(port),
        "-n",
        "128",
        *models,
        *extra,
    ]
    server = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL, cwd="/tmp")
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"server exited: {' '.join(cmd)}")
        time.sleep(0.5)
    raise SystemExit("server did not start")


def replay(
    url: str, pauses: list[dict], timeout: float, debounce: float, beside: bool = False
) -> list[dict]:
    rows, background = [], []
    for p in pauses:
        if p["ring_changed"]:  # fire and forget, as the plugin's timer does
            t = threading.Thread(target=post, args=(url, warm_up(p), timeout), daemon=True)
            t.start()
            background.append(t)
        time.sleep(debounce)
        first_s, first = post(url, fim(p, 250), timeout)
        row = {"first_s": first_s, "starved": first is None}
        if first is not None and "content" not in first:
            row["error"] = first.get("status")  # no suggestion: the server refused it
            row["message"] = first.get("error")
        if first is not None and "content" in first:
            row["predicted"] = first.get("timings/predicted_n")
            row["cached"] = first.get("tokens_cached")
            row["prompt_n"] = first.get("timings/prompt_n")
            row["content"] = first["content"]
            body = fim(p, 1000, p["prompt"] + first["content"])
            if beside:  # the next pause's first request will run beside it

                def second_request(row=row, body=body):
                    second_s, second = post(url, body, timeout)
                    row.update(second_s=second_s, second_starved=second is None)

                t = threading.Thread(target=second_request, daemon=True)
                t.start()
                background.append(t)
            else:
                second_s, second = post(url, body, timeout)
                row.update(second_s=second_s, second_starved=second is None)
        rows.append(row)
    for t in background:
        t.join(timeout)
    return rows


def summary(name: str, rows: list[dict], budget: float) -> dict:
    firsts = [r["first_s"] for r in rows]
    seconds = [r["second_s"] for r in rows if "second_s" in r]
    return {
        "server": name,
        "p50_s": statistics.median(firsts),
        "p95_s": pct(firsts, 0.95),
        "within_budget": sum(f <= budget for f in firsts) / len(firsts),
        "starved": sum(r["starved"] or r.get("second_starved", False) for r in rows),
        "refused": sum("error" in r for r in rows),
        "second_p50_s": statistics.median(seconds) if seconds else None,
        "predicted_mean": statistics.mean([r.get("predicted") or 0 for r in rows]),
    }


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--rev", default="fcd72f6^", help="the server before the fixes")
    a.add_argument("--file", default=shutil.__file__, help="the file being edited")
    a.add_argument("--extra", default=os.__file__, help="the ring's other file")
    a.add_argument("--start-line", type=int, default=100)
    a.add_argument("--pauses", type=int, default=8)
    a.add_argument("--timeout", type=float, default=30.0)
    a.add_argument("--debounce", type=float, default=0.3)
    a.add_argument("--budget", type=float, default=0.75, help="t_max_prompt_ms + 250 ms")
    a.add_argument("--target", default="cpu-demo-target")
    a.add_argument("--draft", default="cpu-demo-draft")
    a.add_argument("--json", dest="json_out")
    a.add_argument("--beside", action="store_true",
                   help="second requests run beside the next first; this checkout serial vs batched")  # fmt: skip
    a.add_argument("--beside-rev", help="with --beside: also REV's server, batched")
    args = a.parse_args()
    pauses = session(Path(args.file), Path(args.extra), args.pauses, args.start_line)
    if args.target == "fim-standin":
        text = Path(args.file).read_text() + Path(args.extra).read_text()
        args.target = str(fim_standin(Path("/tmp/specmlx-replay-standin"), text))
    models = ["--target", args.target, "--draft", args.draft]
    if args.beside:
        return beside(args, pauses, models)
    old_tree = Path("/tmp/specmlx-replay-old")
    if not old_tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old_tree),
                        args.rev], check=True, capture_output=True)  # fmt: skip
    rev = subprocess.run(["git", "-C", str(old_tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECMLX_SERVER")}
    servers = {
        f"fixed ({subprocess.run(['git', '-C', str(ROOT), 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()})": {
            **base,
            "PYTHONPATH": str(ROOT),
        },  # noqa: E501
        f"before the fixes ({rev})": {**base, "PYTHONPATH": str(old_tree)},
    }
    results = []
    for name, env in servers.items():
        server, url = start_server([sys.executable], env, models)
        try:
            rows = replay(url, pauses, args.timeout, args.debounce)
        finally:
            server.terminate()
            server.wait(60)
        results.append((name, rows))
        print(json.dumps(summary(name, rows, args.budget)), flush=True)
    print(f"\n{args.pauses} pauses in {Path(args.file).name} from line {args.start_line}, "
          f"ring from {Path(args.extra).name}, timeout {args.timeout:g} s, budget {args.budget:g} s\n")  # fmt: skip
    print("| server | suggestion p50 | p95 | within budget | starved | refused | second request p50 | tokens suggested (mean) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, rows in results:
        s = summary(name, rows, args.budget)
        second = f"{s['second_p50_s']:.2f} s" if s["second_p50_s"] is not None else "-"
        print(f"| {name} | {s['p50_s']:.2f} s | {s['p95_s']:.2f} s | {s['within_budget']:.0%} | "
              f"{s['starved']} | {s['refused']} | {second} | {s['predicted_mean']:.1f} |")  # fmt: skip
    (fixed, a_rows), (old, b_rows) = results
    ratio = (
        summary(fixed, a_rows, args.budget)["p50_s"] / summary(old, b_rows, args.budget)["p50_s"]
    )
    print(f"\np50 fixed / before: {ratio:.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({n: r for n, r in results}, indent=1))
    return 0


def beside(args, pauses: list[dict], models: list[str]) -> int:
    """--beside: this checkout's server one request at a time, then batched."""
    env = {k: v for k, v in os.environ.items() if k != "SPECMLX_SERVER"}
    env["PYTHONPATH"] = str(ROOT)
    runs = [("one at a time (--max-batch 1)", ["--max-batch", "1"], env),
            ("batched (default --max-batch)", [], env)]  # fmt: skip
    if args.beside_rev:  # an earlier checkout's batched server, from a worktree of it
        tree = Path(f"/tmp/specmlx-replay-{args.beside_rev}")
        if not tree.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree),
                            args.beside_rev], check=True, capture_output=True)  # fmt: skip
        runs.append((f"batched at {args.beside_rev}", [], env | {"PYTHONPATH": str(tree)}))
    results = []
    for name, extra, env in runs:
        server, url = start_server([sys.executable], env, models, extra)
        try:
            rows = replay(url, pauses, args.timeout, args.debounce, beside=True)
        finally:
            server.terminate()
            server.wait(60)
        results.append((name, rows))
        print(json.dumps(summary(name, rows, args.budget)), flush=True)
    print(f"\n{args.pauses} pauses, second requests beside the next first; timeout "
          f"{args.timeout:g} s, budget {args.budget:g} s\n")  # fmt: skip
    print(
        "| server | suggestion p50 | p95 | within budget | starved | refused | second request p50 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rows in results:
        s = summary(name, rows, args.budget)
        second = f"{s['second_p50_s']:.2f} s" if s["second_p50_s"] is not None else "-"
        print(f"| {name} | {s['p50_s']:.2f} s | {s['p95_s']:.2f} s | {s['within_budget']:.0%} | "
              f"{s['starved']} | {s['refused']} | {second} |")  # fmt: skip
    (_, a_rows), (_, b_rows), *rest = results
    ratio = summary("", b_rows, args.budget)["p50_s"] / summary("", a_rows, args.budget)["p50_s"]
    print(f"\np50 batched / one at a time: {ratio:.2f}x")
    for name, rows in rest:
        ratio = summary("", b_rows, args.budget)["p50_s"] / summary("", rows, args.budget)["p50_s"]
        print(f"p50 batched / {name}: {ratio:.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({n: r for n, r in results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
