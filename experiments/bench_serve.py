"""Concurrent clients against real servers over HTTP (issue 38): aggregate tok/s and
per-request p50/p95 latency at 1, 2, 4 and 8 clients, greedy and T = 0.8.

  . scripts/env.sh && .venv/bin/python experiments/bench_serve.py [--target T --draft D -n 48]

Servers, each started in turn (a 2-core machine cannot host two fairly), on one port, with
the same pair:
- batch spec: `specmlx serve` as it starts by default (batches of up to --max-batch rows,
  the pair's k per round from BatchK);
- serial: `specmlx serve --max-batch 1` (one request at a time: the server before issue 38);
- batch k=0: `specmlx serve --draft none` (batched plain decoding);
- mlx-lm: `python -m mlx_lm.server --model TARGET` (it batches only without a draft).

At each width B, B clients (the official openai client, one thread each) send one completion
each at once: the built-in prompt set's first B prompts, -n tokens, temperature T, seed i
(none to mlx-lm: its server serves a request that has a seed alone, outside its batch).
Aggregate tok/s is the completion tokens of all B over the wall time from the first send to
the last answer; a request's latency is its own wall time. Every server first answers a
warm-up request (loading, compiling and its adaptive state are not timed). Greedy rows say
whether every request's text equals the serial server's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specmlx.bench.data import read_jsonl  # noqa: E402
from specmlx.machine import blas_in_use  # noqa: E402
from specmlx.models.registry import load_registry  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int) -> subprocess.Popen:
    """Start a server and wait until it answers /health (mlx-lm's: /v1/models)."""
    env = {k: v for k, v in os.environ.items() if k != "SPECMLX_SERVER"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            cwd="/tmp")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        for path in ("/health", "/v1/models"):
            try:
                if httpx.get(url + path, timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {' '.join(cmd)}")
        time.sleep(0.5)
    raise SystemExit("server did not start")


def at_once(work, n: int) -> tuple[float, list]:
    """work(i) for i < n in n threads that start together: (wall seconds from the start to
    the last one's end, each one's result)."""
    out: list = [None] * n
    go = threading.Barrier(n + 1)

    def one(i: int) -> None:
        go.wait()
        out[i] = work(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


def wave(
    url: str, prompts: list[str], n: int, temp: float, no_seed: bool = False
) -> tuple[float, list[dict]]:
    """B requests at once; (wall seconds, one row per request: latency, tokens, text).
    no_seed: send no seed (mlx-lm's server serves a request with a seed alone, unbatched)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=900)

    def one(i: int) -> dict:
        t = time.perf_counter()
        seed = {} if no_seed else {"seed": 100 + i}
        got = client.completions.create(model="default_model", prompt=prompts[i],
                                        max_tokens=n, temperature=temp, **seed)  # fmt: skip
        return {"latency_s": time.perf_counter() - t, "text": got.choices[0].text,
                "tokens": got.usage.completion_tokens}  # fmt: skip

    return at_once(one, len(prompts))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cpu-demo-target")
    ap.add_argument("--draft", default="cpu-demo-draft")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--systems", default="serial,batch spec,batch k=0,mlx-lm")
    ap.add_argument("--warm-widths", default="",
                    help="also warm up with one untimed wave of 16 tokens at each of these widths")  # fmt: skip
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    warm = [int(b) for b in a.warm_widths.split(",") if b]
    widths = [int(b) for b in a.clients.split(",")]
    temps = [float(t) for t in a.temps.split(",")]
    texts = [p for _, p in read_jsonl(None, "prompts.jsonl", "prompts")][: max(widths)]
    prompts = [t["prompt"] if isinstance(t, dict) else t for t in texts]
    target_dir = load_registry().resolve(a.target).path
    py = [sys.executable, "-m"]
    pair = ["--target", a.target]
    commands = {
        "serial": [*py, "specmlx", "serve", "-q", *pair, "--draft", a.draft, "--max-batch", "1"],
        "batch spec": [*py, "specmlx", "serve", "-q", *pair, "--draft", a.draft],
        "batch k=0": [*py, "specmlx", "serve", "-q", *pair, "--draft", "none"],
        "mlx-lm": [*py, "mlx_lm.server", "--model", str(target_dir)],
    }
    results: dict[str, dict] = {}
    for name in a.systems.split(","):
        port = free_port()
        proc = start([*commands[name], "--port", str(port)], port)
        url = f"http://127.0.0.1:{port}"
        try:
            wave(url, prompts[:1], 8, 0.0)  # the warm-up
            for b in warm:  # the batch's k chooser measures each width once, untimed
                wave(url, prompts[:b], 16, 0.0, no_seed=name == "mlx-lm")
            for temp in temps:
                for b in widths:
                    wall, rows = wave(url, prompts[:b], a.n, temp, no_seed=name == "mlx-lm")
                    results.setdefault(name, {})[f"{temp:g}/{b}"] = {"wall_s": wall, "rows": rows}
                    tokens = sum(r["tokens"] for r in rows)
                    print(json.dumps({"system": name, "T": temp, "B": b,
                                      "tok_s": tokens / wall}), flush=True)  # fmt: skip
        finally:
            proc.terminate()
            proc.wait(120)
    print(f"\nBLAS: {blas_in_use() or 'none found'}; -n {a.n}; {a.target} <- {a.draft}\n")
    print("| T | clients | server | tok/s | vs serial | p50 s | p95 s | same text |")
    print("|---|---|---|---|---|---|---|---|")
    for temp in temps:
        for b in widths:
            key = f"{temp:g}/{b}"
            base = results.get("serial", {}).get(key)
            for name, cells in results.items():
                cell = cells.get(key)
                if cell is None:
                    continue
                rows = cell["rows"]
                rate = sum(r["tokens"] for r in rows) / cell["wall_s"]
                vs, same = "", ""
                if base is not None:
                    vs = f"{rate / (sum(r['tokens'] for r in base['rows']) / base['wall_s']):.2f}x"
                    if temp == 0 and name != "serial":
                        texts = [r["text"] for r in rows] == [r["text"] for r in base["rows"]]
                        same = "yes" if texts else "no"
                lat = [r["latency_s"] for r in rows]
                print(f"| {temp:g} | {b} | {name} | {rate:.2f} | {vs} | "
                      f"{statistics.median(lat):.1f} | {pct(lat, 0.95):.1f} | {same} |")  # fmt: skip
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
