"""SIGTERM under load: N clients on `specmlx serve` (tiny random models from tests/helpers.py:
mechanics only), half streaming, half not, all long enough to be running or queued when the
server gets SIGTERM. Counts how each ended: a stream with its final event and [DONE], a
response (200 or a 503 in OpenAI's shape), or cut (no final event, a connection error).

    .venv/bin/python experiments/sigterm_load.py [--clients 24] [--grace 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import Server, tiny_pair  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--grace", type=float, default=3.0)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    env = dict(os.environ, SPECMLX_MODELS=str(tiny_pair(root)), SPECMLX_HOME=str(root / "h"))
    s = Server(env, "--shutdown-grace", str(a.grace), "--max-queue", "16")
    outcomes: Counter = Counter()
    lock = threading.Lock()

    def client(i: int) -> None:
        body = {"prompt": f"def f{i}(x):\n", "max_tokens": 1500, "draft": "none"}
        try:
            if i % 2 == 0:  # the first (the one that runs) streams
                with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True},
                                  timeout=120) as r:  # fmt: skip
                    if r.status_code != 200:
                        what = f"stream refused {r.status_code}"
                        code = json.loads(r.read()).get("error", {}).get("code")
                        what += f" ({code})"
                    else:
                        lines = [ln for ln in r.iter_lines() if ln]
                        done = lines and lines[-1] == "data: [DONE]"
                        last = json.loads(lines[-2][6:]) if done and len(lines) > 1 else {}
                        how = last.get("error", {}).get("code") or "finished"
                        what = f"stream ended with [DONE] ({how})" if done else "stream cut"
            else:
                r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
                code = r.json().get("error", {}).get("code") if r.status_code != 200 else ""
                what = f"response {r.status_code} {code}".strip()
        except httpx.HTTPError as e:
            what = f"cut: {type(e).__name__}"
        with lock:
            outcomes[what] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    time.sleep(1.0)  # all in flight: one running, the rest queued or refused
    health = httpx.get(s.url + "/health").json()
    t0 = time.monotonic()
    code, err = s.stop()
    for t in threads:
        t.join(60)
    print(f"{a.clients} clients, SIGTERM with --shutdown-grace {a.grace}: server exit {code} "
          f"after {time.monotonic() - t0:.1f} s, traceback in stderr: {'Traceback' in err}; "
          f"at SIGTERM: {health}")  # fmt: skip
    for what, n in sorted(outcomes.items()):
        print(f"  {n:3d}  {what}")


if __name__ == "__main__":
    main()
