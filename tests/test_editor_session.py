"""An editor session as a test (issue 63): two llama.vim-shaped editors at once against a real
`specmlx serve --cache-reuse 256` with its default settings (trees auto, batching, the
prompt cache), over real HTTP on 127.0.0.1. Each editor walks its own file (a module of
Python's standard library) with a seeded hand: cursor moves near and far, typing, Tab
accepting the suggestion shown; as llama.vim does, a ring of other files' chunks that
changes now and then and is sent as a warm-up (n_predict 0) without waiting for it, while
a suggestion may be in flight; after each suggestion the speculative request for the
position after accepting it, also not waited for. The bodies are llama.vim's own fields
(autoload/llama.vim: n_predict 128 capped here, top_k 40, top_p 0.99, t_max_predict_ms,
samplers, id_slot, cache_prompt), and the prompts fill the 2048-token context, so the
server fits them as llama-server does.

Checks: every answer is a 200, over at least 200 requests; every greedy suggestion is what a
fresh server gives for the same body from a fresh prefill (``cache_prompt: false``; without
the time limit, so a suggestion the limit cut is a prefix of it). The target has one layer,
whose moved keys are exactly a fresh prefill's (test_cache_reuse), so even suggestions made
from moved caches must match."""

from __future__ import annotations

import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from helpers import Server, tiny_pair
from kit_serve import server_env

STEPS = 44  # pauses per editor: with their follow-ups and warm-ups, over 200 requests
N_PREDICT = 16
FIELDS = ["content", "stop_type", "tokens_cached", "timings/prompt_n", "truncated"]


def source(name: str) -> list[str]:
    """A standard-library module's lines: a real file to edit."""
    import importlib

    path = Path(importlib.import_module(name).__file__)
    return path.read_text().splitlines(keepends=True)


def fim(lines: list[str], row: int, typed: str, ring: list[dict], t_max: int) -> dict:
    """llama.vim's FIM request with the cursor after ``typed`` in ``row``: 256 lines
    before, 64 after (its n_prefix, n_suffix), the ring of other chunks."""
    line = lines[row] if row < len(lines) else ""
    return {
        "id_slot": -1, "input_prefix": "".join(lines[max(0, row - 256) : row]), "prompt": typed,
        "input_suffix": line[len(typed):] + "".join(lines[row + 1 : row + 65]),
        "input_extra": ring, "n_predict": N_PREDICT, "n_indent": 0, "top_k": 40,
        "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": t_max,
        "response_fields": FIELDS,
    }  # fmt: skip


def warm_up(ring: list[dict]) -> dict:
    return {
        "input_extra": ring, "n_predict": 0, "samplers": [], "cache_prompt": True,
        "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""],
    }  # fmt: skip


class Editor:
    """One editor's seeded session against ``url``: what it sent and what came back."""

    def __init__(self, url: str, own: str, other: str, seed: int):
        self.url, self.rng = url, random.Random(seed)
        self.lines, self.other = source(own), source(other)
        self.sent: list[tuple[dict, int, dict]] = []  # (body, status, answer)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(2)  # the requests llama.vim does not wait for
        self.error: BaseException | None = None

    def __call__(self) -> None:
        try:
            self.run()
        except BaseException as e:  # (a thread's error fails the test, not just warns)
            self.error = e

    def post(self, body: dict) -> dict:
        # (a warm-up waits until no editor request runs or waits: the whole session, here)
        r = httpx.post(self.url + "/infill", json=body, timeout=600)
        with self.lock:
            self.sent.append((body, r.status_code, r.json() if r.status_code == 200 else r.text))
        return r.json() if r.status_code == 200 else {}

    def ring(self) -> list[dict]:
        at = self.rng.randrange(0, max(1, len(self.other) - 64))
        return [{"filename": "other.py", "text": "".join(self.other[at : at + 64])}]

    def run(self) -> None:
        n = len(self.lines)
        row, typed, ring, pending = self.rng.randrange(n // 3, 2 * n // 3), "", self.ring(), []
        for _ in range(STEPS):
            act = self.rng.random()
            if act < 0.45:  # a near move: a few lines up or down
                row, typed = min(max(1, row + self.rng.randint(-3, 3)), len(self.lines) - 1), ""
            elif act < 0.6:  # a far move: another place in the file
                row, typed = self.rng.randrange(1, len(self.lines) - 1), ""
            elif act < 0.85:  # typing: the line's next few characters
                line = self.lines[row].rstrip("\n")
                typed = line[: min(len(line), len(typed) + self.rng.randint(1, 6))]
            if self.rng.random() < 0.4:  # the ring took another chunk: warm it up
                ring = self.ring()
                pending.append(self.pool.submit(self.post, warm_up(ring)))
            shown = self.post(fim(self.lines, row, typed, ring, 250)).get("content", "")
            # the speculative request for the position after accepting it, not waited for
            pending.append(self.pool.submit(self.post, fim(self.lines, row, typed + shown, ring, 1000)))  # fmt: skip
            if act >= 0.85 and shown:  # Tab: the suggestion goes into the buffer
                done = (typed + shown).split("\n")
                self.lines[row : row + 1] = [d + "\n" for d in done[:-1]] + [done[-1] + "\n"]
                row, typed = row + len(done) - 1, done[-1]
        for f in pending:
            f.result()
        self.pool.shutdown()


def test_two_editors_against_cache_reuse_get_only_200s_and_fresh_servers_answers(tmp_path):
    toml = tiny_pair(tmp_path, fim=True, num_hidden_layers=1)
    env = server_env(tmp_path, toml)
    s = Server(env, "-q", "--cache-reuse", "256")
    try:
        editors = [Editor(s.url, "json.decoder", "json.encoder", 1),
                   Editor(s.url, "argparse", "textwrap", 2)]  # fmt: skip
        threads = [threading.Thread(target=e) for e in editors]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not any(t.is_alive() for t in threads)
        for e in editors:
            if e.error is not None:
                raise e.error
        metrics = httpx.get(s.url + "/metrics").text
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err
    sent = [x for e in editors for x in e.sent]
    bad = [(status, answer) for _, status, answer in sent if status != 200]
    assert len(sent) >= 200 and not bad, (len(sent), bad[:3])
    suggestions = [(body, answer) for body, _, answer in sent if body["n_predict"] > 0]
    assert any(a["tokens_cached"] > 0 for _, a in suggestions)
    assert any(a["truncated"] for _, a in suggestions)  # prompts past the context, fitted
    moved = [
        line
        for line in metrics.splitlines()
        if line.startswith("specmlx_prompt_cache_moved_tokens_total")
    ]
    assert moved and float(moved[0].split()[-1]) > 0, moved  # runs were moved
    fresh = Server(server_env(tmp_path, toml), "-q")
    try:
        replayed = {}
        for body, answer in suggestions:
            key = json.dumps(body, sort_keys=True)
            if key in replayed:
                assert replayed[key] == answer["content"] or answer["stop_type"] == "limit"
                continue
            again = body | {"cache_prompt": False, "t_max_predict_ms": 0}
            r = httpx.post(fresh.url + "/infill", json=again, timeout=120)
            assert r.status_code == 200, r.text
            want = replayed[key] = r.json()["content"]
            if answer["stop_type"] == "limit":  # the time limit cut it
                assert want.startswith(answer["content"]), json.dumps([answer, want])
            else:
                assert answer["content"] == want, json.dumps([answer, want])
    finally:
        code, err = fresh.stop()
    assert code == 0 and "Traceback" not in err, err
