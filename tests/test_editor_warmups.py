"""Editors' warm-ups (llama.vim's n_predict 0) through the worker (no HTTP): a warm-up fills
the prompt cache for later and never delays a suggestion someone is waiting for. It waits
while an editor request runs or waits (serving/warmups.py), batched or one at a time, and
runs once the editors are quiet."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import tiny_pair

from specmlx.decoding.session import DrafterChoice, Request
from specmlx.drafting.choosing.choosers import K
from specmlx.models.loading import load_pair
from specmlx.models.registry import load_registry
from specmlx.serving.worker import Worker

CODE = "import os\nfor i in range(10):\n    print(i, os.getcwd())\n"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("warmups")
    return load_pair("tiny-t", "tiny-d", registry=load_registry([tiny_pair(root)]), context=2048)


@pytest.fixture(params=[4, 1], ids=["batched", "one at a time"])
def worker(pair, request):
    t, d, shared = pair
    w = Worker(t, d, shared, persist=False, lookup_memory=False, max_batch=request.param,
               cache_budget=64 << 20)  # fmt: skip
    w.start()
    yield w
    w.stop()


def ask(worker, log, name, prompt, n, **kw):
    """Submit a request; its events go into ``log`` as (name, kind); returns (job, an event
    set when it is done)."""
    ids = worker.target.tokenizer.encode(prompt)
    done = threading.Event()

    def emit(kind, _value):
        log.append((name, kind))
        if kind in ("done", "error"):
            done.set()

    editor = kw.pop("editor", False)
    return worker.submit(Request(prompt_ids=ids, max_tokens=n, **kw), emit, editor), done


def wait_for(cond, timeout=60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def pieces(log, name) -> int:
    return sum(x == (name, "piece") for x in log)


WARM = dict(editor=True, warm_up=True)  # as /infill sends llama.vim's n_predict 0


def run_between(worker, second: dict) -> list[str]:
    """A suggestion runs (batched: a batch of one; one at a time: the worker's one
    job); ``second``, a long prompt, arrives; then another suggestion (batched: it parks
    the first; one at a time: it queues behind ``second``). Returns the names in the order
    they were answered."""
    log: list = []
    _, first = ask(worker, log, "sugg", CODE * 2, 80, editor=True, k=K(3))
    wait_for(lambda: pieces(log, "sugg") >= 3)
    _, other = ask(worker, log, "other", CODE * 12, 1, **second)
    _, then = ask(worker, log, "next", "def g(y):\n", 12, editor=True, k=K(3))
    assert first.wait(120) and then.wait(120) and other.wait(120)
    assert not [x for x in log if x[1] == "error"], log
    return [name for name, kind in log if kind == "done"]


def test_a_warm_up_waits_until_the_suggestions_are_answered(worker):
    """The warm-up's prefill runs only after every suggestion is answered (it ran between
    two rounds of the first, or before the one queued behind it), and it still fills the
    prompt cache. The control: a request that is not a warm-up in the same place (prompt
    lookup, which runs alone as a warm-up did) is answered before the last suggestion, so
    the order checked is one that can fail."""
    ends = run_between(worker, WARM)
    assert ends[-1] == "other", ends
    log: list = []  # it filled the cache: a request with its prompt finds it there
    job, done = ask(worker, log, "after", CODE * 12, 2)
    assert done.wait(60) and job.stats.cached_tokens >= job.stats.prompt_tokens - 2
    ends = run_between(worker, dict(drafter=DrafterChoice.of("lookup"), k=K(3)))
    assert ends.index("other") < ends.index("next"), ends


def test_a_waiting_warm_up_whose_client_left_is_dropped(worker):
    log: list = []
    _, first = ask(worker, log, "sugg", CODE * 2, 60, editor=True, k=K(3))
    wait_for(lambda: pieces(log, "sugg") >= 2)
    cancelled = worker.totals.cancelled
    warm, _ = ask(worker, log, "warm", CODE * 12, 1, **WARM)
    _, second = ask(worker, log, "next", "def g(y):\n", 8, editor=True, k=K(3))
    warm.cancel()
    assert first.wait(120) and second.wait(120)
    wait_for(lambda: worker.totals.cancelled == cancelled + 1)
    assert not [x for x in log if x[0] == "warm"]  # never run, never answered
    assert not worker.running()


def test_a_warm_up_on_a_quiet_server_runs_at_once_and_parks_nothing(worker):
    """Nothing running: the warm-up is served at once. With a batch, it neither parks an
    editor request nor restarts the grace a parked one waits out (``_quiet_from``)."""
    b = worker._batcher
    log: list = []
    before = b._quiet_from if b is not None else None
    t0 = time.monotonic()
    _, done = ask(worker, log, "warm", CODE * 4, 1, **WARM)
    assert done.wait(30) and log == [("warm", "done")]
    assert time.monotonic() - t0 < 10
    if b is not None:
        assert b._quiet_from == before and not b.parked and not b.live
