"""The editor benchmark: successive completions on one source file, the prefix a line longer
each time (as if typing), once as a one-shot `specmlx run` per completion and once through
`specmlx serve`, interleaved step by step so drift hits both alike.

Reports per-completion latency (p50/p95 of whole-request wall time), the prompt tokens served
from the prompt cache, decode tok/s of both, and whether every completion is token-identical.
Run it as experiments/bench-editor (it uses the project's .venv).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from specmlx.machine import blas_in_use, version


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "file", nargs="?", default=textwrap.__file__, help="source file (default: textwrap.py)"
    )
    p.add_argument("--start-line", type=int, default=120, help="lines in the first prefix")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("-n", "--max-tokens", type=int, default=32)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--json", dest="json_out", help="write every measurement here")
    a = p.parse_args()
    lines = Path(a.file).read_text().splitlines(keepends=True)
    prefixes = ["".join(lines[: a.start_line + i]) for i in range(a.steps)]
    models = [
        *(["--target", a.target] if a.target else []),
        *(["--draft", a.draft] if a.draft else []),
    ]
    specmlx = [str(Path(sys.executable).parent / "specmlx")]
    env = {k: v for k, v in os.environ.items() if k != "SPECMLX_SERVER"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    server = subprocess.Popen([*specmlx, "serve", "-q", "--port", str(port), *models], env=env,
                              stderr=subprocess.PIPE)  # fmt: skip
    while True:
        try:
            httpx.get(url + "/health", timeout=1)
            break
        except httpx.TransportError:
            if server.poll() is not None:
                print(server.stderr.read().decode(), file=sys.stderr)
                return 1
            time.sleep(0.2)
    startup = time.perf_counter() - t0
    rows = []
    try:
        for i, prefix in enumerate(prefixes):
            t = time.perf_counter()
            done = subprocess.run([*specmlx, "run", "--json", "-q", "-n", str(a.max_tokens), *models, "-"],
                                  input=prefix.encode(), capture_output=True, env=env)  # fmt: skip
            one_s = time.perf_counter() - t
            if done.returncode != 0:
                print(done.stderr.decode(), file=sys.stderr)
                return 1
            one = json.loads(done.stdout)
            t = time.perf_counter()
            body = {"prompt": prefix, "max_tokens": a.max_tokens, "return_tokens": True}
            served = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
            served_s = time.perf_counter() - t
            usage, spec = served["usage"], served["specmlx"]
            rows.append({
                "step": i,
                "prompt_tokens": usage["prompt_tokens"],
                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                "one_shot_s": one_s,
                "served_s": served_s,
                "one_shot_decode_tps": one["stats"]["decode_tps"],
                "one_shot_generated": one["stats"]["generated"],
                "one_shot_decode_s": one["stats"]["decode_s"],
                "served_decode_tps": spec["decode_tps"],
                "served_generated": usage["completion_tokens"],
                "served_decode_s": spec["decode_s"],
                "identical": served["choices"][0]["token_ids"] == one["tokens"],
            })  # fmt: skip
            r = rows[-1]
            print(
                f"step {i}: {r['prompt_tokens']} prompt tok ({r['cached_tokens']} cached)  "
                f"one-shot {one_s:.1f} s  served {served_s:.1f} s  identical {r['identical']}",
                file=sys.stderr,
            )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    one = [r["one_shot_s"] for r in rows]
    srv = [r["served_s"] for r in rows]
    later = rows[1:]
    cached = sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later))
    tps_one = sum(r["one_shot_generated"] for r in rows) / sum(r["one_shot_decode_s"] for r in rows)
    tps_srv = sum(r["served_generated"] for r in rows) / sum(r["served_decode_s"] for r in rows)
    summary = {
        "file": a.file, "steps": a.steps, "max_tokens": a.max_tokens,
        "server_startup_s": startup,
        "one_shot_p50_s": statistics.median(one), "one_shot_p95_s": pct(one, 0.95),
        "served_p50_s": statistics.median(srv), "served_p95_s": pct(srv, 0.95),
        "p50_ratio": statistics.median(srv) / statistics.median(one),
        "cached_fraction_from_step_2": cached,
        "one_shot_decode_tps": tps_one, "served_decode_tps": tps_srv,
        "decode_ratio": tps_srv / tps_one,
        "all_identical": all(r["identical"] for r in rows),
        "blas": blas_in_use(), "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
        "specmlx": version("specmlx"),
    }  # fmt: skip
    print(
        f"\n| | one-shot `specmlx run` | `specmlx serve` | served / one-shot |\n|---|---|---|---|\n"
        f"| latency p50 | {summary['one_shot_p50_s']:.2f} s | {summary['served_p50_s']:.2f} s | "
        f"{summary['p50_ratio']:.2f}x |\n"
        f"| latency p95 | {summary['one_shot_p95_s']:.2f} s | {summary['served_p95_s']:.2f} s | |\n"
        f"| decode tok/s (pooled) | {tps_one:.2f} | {tps_srv:.2f} | {summary['decode_ratio']:.2f}x |\n"
        f"| prompt tokens from the cache, steps 2-{a.steps} | - | {cached:.0%} | |\n"
        f"| token-identical | | | {sum(r['identical'] for r in rows)}/{len(rows)} |\n\n"
        f"server startup (load once) {startup:.1f} s; BLAS {summary['blas']}"
    )
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
