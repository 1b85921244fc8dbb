"""Chat clients that share one system prompt, at once, against this checkout's batched server
and an earlier checkout's (the prompt cache: copied entries against taken ones).

  . scripts/env.sh && .venv/bin/python experiments/bench_chat_prefix.py --rev c89112f

Each server (started in turn: a 2-core machine cannot host two fairly) first answers one
untimed chat with the system prompt, as a server that has been up a while has (with --cold,
a chat without it: the system prompt is new to the server when the clients start). Then
--clients clients start at once; each holds --conversations conversations of --turns turns,
one after another (a turn sends the whole conversation so far, the server's own replies
included), greedy, -n tokens a reply, streamed. Per request: the time to the first token and
how much of the prompt came from the prompt cache. The system prompt is project context a
coding assistant would carry (a standard-library module's source). Texts are compared across
the servers (greedy: they must be equal).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from bench_serve import at_once, pct  # noqa: E402
from replay_llamavim import start_server  # noqa: E402

from specmlx.machine import blas_in_use  # noqa: E402

QUESTIONS = [
    "What does dedent do?", "Write a test for fill.", "Is wrap thread-safe?",
    "Explain the regex in wrap.", "How do I indent only some lines?", "Shorten a long title.",
    "What is the default width?", "Why a class and not functions?", "List the options.",
    "How are tabs expanded?", "Make wrap keep blank lines.", "What breaks on hyphens?",
    "Can I wrap code?", "Rewrite fill in one line.", "What does max_lines do?",
    "Where is the placeholder used?",
]  # fmt: skip


def client_run(url: str, system: str, asks: list[list[str]], n: int) -> list[dict]:
    """One client's conversations, turn after turn: a row per request."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=1800)
    rows = []
    for conversation in asks:
        messages = [{"role": "system", "content": system}]
        for q in conversation:
            messages.append({"role": "user", "content": q})
            t = time.perf_counter()
            first, parts, usage = None, [], None
            stream = client.chat.completions.create(
                model="default_model", messages=messages, max_tokens=n, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter() - t
                    parts.append(chunk.choices[0].delta.content)
                usage = chunk.usage or usage
            reply = "".join(parts)
            messages.append({"role": "assistant", "content": reply})
            rows.append({"ttft_s": first or time.perf_counter() - t,
                         "latency_s": time.perf_counter() - t, "text": reply,
                         "prompt": usage.prompt_tokens,
                         "cached": usage.prompt_tokens_details.cached_tokens})  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="cpu-demo-target")
    ap.add_argument("--draft", default="cpu-demo-draft")
    ap.add_argument("--rev", required=True, help="the earlier checkout to run beside")
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--system-chars", type=int, default=1600)
    ap.add_argument("--cold", action="store_true", help="the warm-up has no system prompt")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    system = "You are a coding assistant for this module:\n" + inspect.getsource(textwrap)
    system = system[: a.system_chars]
    qs = iter(QUESTIONS * 8)
    plan = [[[next(qs) for _ in range(a.turns)] for _ in range(a.conversations)]
            for _ in range(a.clients)]  # fmt: skip
    tree = Path(f"/tmp/specmlx-chat-{a.rev}")
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), a.rev],
                       check=True, capture_output=True)  # fmt: skip
    here = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECMLX_SERVER")}
    servers = [(f"this checkout ({here})", env | {"PYTHONPATH": str(ROOT)}),
               (f"before ({a.rev})", env | {"PYTHONPATH": str(tree)})]  # fmt: skip
    models = ["--target", a.target, "--draft", a.draft]
    results = {}
    for name, e in servers:
        server, url = start_server([sys.executable], e, models)
        try:
            client_run(url, "" if a.cold else system, [["Hello."]], 4)  # untimed
            wall, rows = at_once(
                lambda i, url=url: client_run(url, system, plan[i], a.n), len(plan)
            )
        finally:
            server.terminate()
            server.wait(120)
        results[name] = {"wall_s": wall, "clients": rows}
        flat = [r for c in rows for r in c]
        print(json.dumps({"server": name, "wall_s": round(wall, 1),
                          "cached": sum(r["cached"] for r in flat),
                          "prompt": sum(r["prompt"] for r in flat)}), flush=True)  # fmt: skip
    print(f"\nBLAS: {blas_in_use() or 'none found'}; {a.target} <- {a.draft}; {a.clients} "
          f"clients x {a.conversations} conversations x {a.turns} turns, -n {a.n}, system "
          f"prompt {a.system_chars} chars{', new to the server' if a.cold else ''}\n")  # fmt: skip
    print("| server | wall s | first token p50 s | p95 s | prompt tokens from the cache | "
          "prefilled | same text |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    texts = None
    for name, res in results.items():
        flat = [r for c in res["clients"] for r in c]
        ttft = [r["ttft_s"] for r in flat]
        cached, prompt = sum(r["cached"] for r in flat), sum(r["prompt"] for r in flat)
        same = "" if texts is None else ("yes" if [r["text"] for r in flat] == texts else "no")
        texts = texts or [r["text"] for r in flat]
        print(f"| {name} | {res['wall_s']:.1f} | {statistics.median(ttft):.2f} | "
              f"{pct(ttft, 0.95):.2f} | {cached / prompt:.0%} ({cached} of {prompt}) | "
              f"{prompt - cached} | {same} |")  # fmt: skip
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
