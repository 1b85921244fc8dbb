"""The one generation builder (session.py) and the text stream above the engine: stop strings
across token boundaries, the EOS merge, adaptive state kept across generations, and no other
module assembling a generation itself."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import generate, make_tiny, tiny_tokenizer
from mlx_lm.tokenizer_utils import TokenizerWrapper

from specmlx.core.sampling import SamplingParams
from specmlx.core.stats import Stats, TokenEvent
from specmlx.decoding.session import DrafterChoice, Pair, Request, Session
from specmlx.decoding.stream import _held_back, editor_limits, stream_text
from specmlx.drafting.choosing.adaptive import AdaptiveK
from specmlx.drafting.choosing.choosers import AUTO as AUTO_K
from specmlx.drafting.choosing.choosers import ChooserStore, K
from specmlx.drafting.lookup.kinds import SUFFIX

PACKAGE = Path(__file__).resolve().parent.parent / "specmlx"
TEXT = "import os\nfor i in range(10):\n    print(i, os.getcwd())\n"


@pytest.fixture(scope="module")
def tok():
    return TokenizerWrapper(tiny_tokenizer())


@pytest.fixture(scope="module")
def models(tok):
    vocab = len(tok._tokenizer)
    return make_tiny(0, vocab=vocab, sharpen=4.0), make_tiny(1, vocab=vocab, sharpen=4.0)


def _events(tok, text):
    """The token events of ``text`` and a flag telling whether the stream was closed."""
    closed = []

    def gen():
        try:
            for t in tok.encode(text):
                yield TokenEvent(t, False)
        finally:
            closed.append(True)

    return gen(), closed


@pytest.mark.parametrize(
    ("text", "n"), [("abc", 2), ("abcd", 0), ("ab", 1), ("xyz", 2), ("xy", 1), ("abx", 0)]
)
def test_held_back_is_the_longest_suffix_that_may_begin_a_stop(text, n):
    assert _held_back(text, ["bcd", "yzz"]) == n


def test_a_stop_string_across_tokens_ends_the_text_before_it(tok):
    stop = "os.getcwd"
    ids = tok.encode(TEXT)
    pieces = [tok.decode([t]) for t in ids]
    assert not any(stop in p for p in pieces)  # it spans several tokens
    events, closed = _events(tok, TEXT)
    out = list(stream_text(tok, events, [stop]))
    assert "".join(e.text for e in out) == TEXT[: TEXT.index(stop)]
    assert closed and len(out) < len(ids)  # the generator was closed at the stop


def test_text_that_only_begins_a_stop_string_is_held_then_given_back(tok):
    # "os.get" begins the stop string, which never completes: held while it might, and
    # every character comes out in the end, in order
    events, _ = _events(tok, TEXT)
    out = list(stream_text(tok, events, ["os.getX", "\n\n\n"]))
    assert "".join(e.text for e in out) == TEXT
    held = [e for e in out if e.token is not None and e.text == ""]
    assert held  # some tokens' text was held back while it could begin a stop string


def test_the_session_builds_what_the_engine_generates(tok, models):
    target, draft = models
    prompt = tok.encode("def add(a, b):")
    eos = tok.eos_token_ids
    for use_draft, lookup in ((True, False), (False, True), (True, True), (False, False)):
        session = Session(Pair(target, draft, tok))
        req = Request(
            prompt,
            k=K(3),
            max_tokens=24,
            drafter=DrafterChoice(use_draft, SUFFIX if lookup else None),
        )
        gen = session.start(req)
        got = [(e.token, e.from_draft) for e in gen.tokens()]
        direct = generate(
            target, draft if use_draft else None, prompt, k=3 if use_draft or lookup else 0,
            max_tokens=24, lookup=lookup, eos_ids=sorted(eos),
        )  # fmt: skip
        assert got == [(e.token, e.from_draft) for e in direct]
        assert gen.stats.generated == len(got)


def test_extra_eos_ids_join_the_tokenizers(tok, models):
    target, draft = models
    prompt = tok.encode("def add(a, b):")
    free = [e.token for e in Session(Pair(target, draft)).start(Request(prompt, k=K(2),
            max_tokens=12)).tokens()]  # fmt: skip
    cut = Request(prompt, k=K(2), max_tokens=12, extra_eos=(free[5],))
    gen = Session(Pair(target, draft, tok)).start(cut)
    got = [e.token for e in gen.tokens()]
    assert got == free[: free.index(free[5])] and gen.stats.finish_reason == "stop"


def test_text_joins_to_the_decoded_tokens(tok, models):
    target, draft = models
    gen = Session(Pair(target, draft, tok)).start(
        Request(tok.encode("class Point:"), k=K(2), max_tokens=30)
    )
    events = list(gen.text())
    ids = [e.token for e in events if e.token is not None]
    assert "".join(e.text for e in events) == tok.decode(ids)


def test_auto_k_resumes_from_the_store_and_is_saved(tok, models):
    target, draft = models
    store = ChooserStore(persist=False, pass_ratio=[1.0] + [1.0 + 0.1 * k for k in range(1, 17)])
    session = Session(Pair(target, draft, tok, "t", "d"), choosers=store)
    sampling = SamplingParams(temperature=0.8)
    req = Request(tok.encode("def add(a, b):"), sampling, k=AUTO_K, max_tokens=40, seed=1)
    first = session.start(req)
    list(first.tokens())
    first.finish()
    chooser = store.get(target, "t", "d|lookup=False", sampling, [1], verify=req.verify)
    assert isinstance(chooser, AdaptiveK) and chooser.cost.level is not None  # it learned
    second = session.start(replace(req, prompt_ids=tok.encode("import os")))
    assert second._saved is chooser  # the same state goes on learning


def test_no_module_but_the_session_assembles_a_generation():
    """The CLI, the server's worker and the bench build generations through session.py:
    none calls the engine's generate_tokens, the text stream or the ranks' shared k."""
    builders = {"generate_tokens", "stream_text", "SharedK"}
    paths = [*sorted((PACKAGE / "cli").glob("*.py"))]
    paths += [PACKAGE / f"{name}.py" for name in ("serving/worker", "bench/suite", "serving/serve")]
    assert len(paths) > 5
    for path in paths:
        tree = ast.parse(path.read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not used & builders, (path.name, used & builders)


def _texts(*pieces):
    return iter([TokenEvent(i, False, p) for i, p in enumerate(pieces)])


def test_editor_limits_cut_at_a_shallower_line_and_after_the_time_limit():
    # n_indent: the first line is never checked; a later line starting left of 4 ends it,
    # cut before its first character (as llama.cpp cuts it)
    stats = Stats()
    out = editor_limits(_texts("x = 1\n", "    y = 2\n  ", "z", " = 3"), min_indent=4, stats=stats)
    assert "".join(e.text for e in out) == "x = 1\n    y = 2\n  " and stats.finish_reason == "limit"
    stats = Stats()
    out = editor_limits(_texts("a\n", "\tb\n", "    c"), min_indent=1, stats=stats)
    assert "".join(e.text for e in out) == "a\n\tb\n    c" and stats.finish_reason is None
    # t_max_predict_ms: past the time, stop once a line is done, not before
    now = iter([0.0, 0.5, 1.0, 2.0, 3.0, 4.0])
    stats = Stats()
    out = editor_limits(_texts("def f(", "a, b", "):\n", "    return", " a"), time_limit_s=0.8,
                        stats=stats, clock=lambda: next(now))  # fmt: skip
    # (the clock reads 0.5 s after the newline: under the limit; 1.0 s a token later: over)
    assert "".join(e.text for e in out) == "def f(a, b):\n    return"
    assert stats.finish_reason == "limit"


def test_editor_limits_close_what_they_read():
    closed = []

    def events():
        try:
            yield from _texts("a\n", "b")
        finally:
            closed.append(True)

    list(editor_limits(events(), min_indent=2))
    assert closed == [True]
