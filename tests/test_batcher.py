"""serving/batcher.py through the worker (no HTTP): a request's randomness is its own, so a
seeded sampled request with a fixed k gives its solo text whatever runs beside it, joins
it, parks it or resumes it."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from helpers import tiny_pair

from specmlx.core.sampling import SamplingParams
from specmlx.decoding.session import DrafterChoice, Request
from specmlx.drafting.choosing.choosers import AUTO, K
from specmlx.models.loading import load_pair
from specmlx.models.registry import load_registry
from specmlx.serving.worker import Worker

CODE = "import os\nfor i in range(10):\n    print(i, os.getcwd())\n"
HOT = SamplingParams(1.0)  # hot enough that a different key gives different tokens


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    root: Path = tmp_path_factory.mktemp("batcher")
    registry = load_registry([tiny_pair(root)])
    t, d, shared = load_pair("tiny-t", "tiny-d", registry=registry, context=2048)
    w = Worker(t, d, shared, persist=False, lookup_memory=False, max_batch=4,
               cache_budget=64 << 20)  # fmt: skip
    w.start()
    yield w
    w.stop()


def ask(worker, log, name, prompt, n, **kw) -> threading.Event:
    """Submit a request; its events go into ``log`` as (name, kind, token); the returned
    event is set when it is done."""
    ids = worker.target.tokenizer.encode(prompt)
    done = threading.Event()

    def emit(kind, value):
        log.append((name, kind, getattr(value, "token", None)))
        if kind in ("done", "error"):
            done.set()

    editor = kw.pop("editor", False)
    worker.submit(Request(prompt_ids=ids, max_tokens=n, **kw), emit, editor)
    return done


def pieces(log, name) -> list:
    return [tok for nm, kind, tok in log if nm == name and kind == "piece"]


def wait_for(cond, timeout=60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def solo(worker, prompt, n, **kw) -> list:
    log: list = []
    assert ask(worker, log, "solo", prompt, n, **kw).wait(60)
    assert [kind for _, kind, _ in log if kind == "error"] == []
    return pieces(log, "solo")


@pytest.mark.parametrize("how", ["joined", "parked", "beside an adaptive row"])
def test_a_seeded_sampled_request_gives_its_solo_text_whatever_moves_it(worker, how):
    """The request runs alone (a batch of one); then a second request arrives: it joins the
    batch beside it ("joined": the second asks for adaptive k, so the batch's own choice runs
    beside its fixed k), or a newer editor request sets it aside and it resumes afterwards
    ("parked"); or it starts as a row beside a running adaptive one. Its
    tokens are its solo run's (the same seed, the same fixed k). Controls: another seed
    gives other tokens (the comparison means something)."""
    mine = dict(sampling=HOT, seed=1234, k=K(3), editor=how == "parked")
    want = solo(worker, CODE, 60, **mine)
    assert solo(worker, CODE, 60, **{**mine, "seed": 99}) != want
    log: list = []
    waits = []
    if how == "beside an adaptive row":
        waits.append(ask(worker, log, "other", "class A:\n", 120, k=AUTO))
        wait_for(lambda: len(pieces(log, "other")) >= 2)
    waits.append(ask(worker, log, "mine", CODE, 60, **mine))
    if how != "beside an adaptive row":
        wait_for(lambda: len(pieces(log, "mine")) >= 3)  # it is running alone
        other = dict(k=AUTO, editor=how == "parked")
        waits.append(ask(worker, log, "other", "def g(y):\n", 24, **other))
    assert all(d.wait(120) for d in waits)
    assert [x for x in log if x[1] == "error"] == []
    assert pieces(log, "mine") == want
    if how == "parked":  # it did step aside: no token of its own while the newer ran
        first = next(i for i, x in enumerate(log) if x[:2] == ("other", "piece"))
        last = next(i for i, x in enumerate(log) if x[:2] == ("other", "done"))
        assert not [x for x in log[first:last] if x[:2] == ("mine", "piece")]
        assert any(x[:2] == ("mine", "piece") for x in log[last:])
    else:  # it did run beside the other one
        ends = [i for i, x in enumerate(log) if x[1] == "done"]
        starts = [next(i for i, x in enumerate(log) if x[:2] == (n, "piece"))
                  for n in ("mine", "other")]  # fmt: skip
        assert max(starts) < min(ends), log


def test_a_lone_request_is_a_batch_of_one_drafting_its_own_adaptive_k(worker):
    """Alone, an adaptive request is a row of the batch from its first round (the batch's
    rounds count its passes: nothing runs it through the engine and converts it later), and
    its own adaptive chooser picks its k, as the serial worker's would: its stats say where
    that chooser's estimates came from. Greedy, its text is the target's own."""
    before = worker.totals.batch_rounds
    log: list = []
    ids = worker.target.tokenizer.encode(CODE)
    done = threading.Event()
    job = worker.submit(
        Request(prompt_ids=ids, max_tokens=40, k=AUTO),
        lambda kind, value: (log.append(kind), kind in ("done", "error") and done.set()),
    )
    assert done.wait(60) and "error" not in log
    assert worker.totals.batch_rounds - before == job.stats.rounds > 0
    assert job.stats.auto["from"].startswith(("new", "saved", "this process")), job.stats.auto
    plain = solo(worker, CODE, 40, drafter=DrafterChoice.of("none"))
    assert solo(worker, CODE, 40, k=AUTO) == plain
