"""Lookahead decoding (drafting/lookup/lookahead.py): its settings and their one-line refusals, the
window's tree and its Jacobi update from hand-built argmaxes, one host sync a round, the
target's caches after a generation, auto's window by the pass cost, and `run` and `serve`
with it. Its whole-sequence distribution: the "lookahead" kind in test_drafter_kinds.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from helpers import generate, make_tiny, syncs_per_round, tiny_pair
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.core.kvstate import KVState
from specmlx.core.sampling import SamplingParams
from specmlx.core.stats import Stats
from specmlx.drafting.choosing.adaptive import AdaptiveK
from specmlx.drafting.choosing.choosers import K, make_chooser
from specmlx.drafting.choosing.cost_curve import CostCurve
from specmlx.drafting.lookup.lookahead import LookaheadRows, LookaheadSize
from specmlx.drafting.lookup.memory import Lookup
from specmlx.drafting.lookup.suffix import SEP
from specmlx.errors import BadInput

PROMPT = [5, 17, 30, 2, 41]


@pytest.fixture(scope="module")
def target():
    return make_tiny(11, vocab=48, layers=3, hidden=32, sharpen=2.0)


def test_settings_parse_and_refuse_in_one_line():
    assert LookaheadSize.of("lookahead").auto
    size = LookaheadSize.of("lookahead:w=3,n=4,g=2")
    assert (size.window, size.ngram, size.pool, size.auto, size.nodes) == (3, 4, 2, False, 15)
    assert str(size) == "lookahead:w=3,n=4,g=2" and LookaheadSize.of(str(size)) == size
    assert LookaheadSize.of("lookahead:n=2").window == 4  # the others keep their defaults
    for bad, says in [
        ("lookahead:w=0", "w must be an integer from 1 to 16"),
        ("lookahead:g=17", "g must be an integer from 1 to 16"),
        ("lookahead:n=1", "n must be an integer from 2 to 8"),
        ("lookahead:x=2", "unknown setting 'x'"),
        ("lookahead:w=16,g=16,n=4", "more than 64"),
        ("lookahead:", "expected 'lookahead' or"),
    ]:
        with pytest.raises(BadInput, match=says):
            LookaheadSize.of(bad)


@pytest.mark.parametrize("bad", ["lookahead:w=0", "lookahead:g=99", "lookup:other"])
def test_the_cli_refuses_bad_settings_before_loading(bad):
    r = CliRunner().invoke(app, ["run", "--draft", bad, "def f():"])
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and bad.split("=")[0].split(":")[0] in lines[0], lines


def test_the_window_is_a_tree_and_learns_from_the_targets_argmax():
    ctx = [7, 8, 9, 10]  # nothing repeats: no candidates, the window alone
    row = SimpleNamespace(ctx=ctx, process=None, stats=Stats(), stops=SimpleNamespace(room=50))
    rows = LookaheadRows(
        Lookup(ctx), make_chooser(K(4)), LookaheadSize.of("lookahead:w=3,n=3,g=1"), 48
    )
    drafts = rows.propose([row], 4, [4], [None])
    assert drafts.trees[0].parents == (0, 1, 2) and drafts.chain == 0  # level 0: a chain of guesses
    assert all(t in ctx for t in drafts.tokens[0].tolist())
    assert rows.placed == [1, 2, 3]
    rows.observe([0, 20, 21, 22])  # the target's argmax at the root and the three guesses
    assert rows.levels[1] == [20, 21, 22] and not rows.pool.tokens  # filling: a new level
    first = list(rows.levels[0])
    drafts = rows.propose([row], 4, [4], [None])
    # level 1's guess in each column is the child of level 0's
    assert drafts.trees[0].parents == (0, 1, 2, 1, 2, 3)
    assert drafts.tokens[0].tolist() == first + [20, 21, 22]
    rows.observe([0, 1, 1, 1, 30, 31, 32])  # the full window: n-grams, then a shift
    assert rows.levels == [[20, 21, 22], [30, 31, 32]]
    grams = rows.pool.tokens
    assert grams == [first[0], 20, 30, SEP, first[1], 21, 31, SEP, first[2], 22, 32, SEP]
    # the pool now proposes: after [.., 20] comes 30 (the verification branch)
    row.ctx += [first[0], 20]
    rows.settle([row], 0, [0], [0], None)
    drafts = rows.propose([row], 4, [4], [None])
    assert drafts.tokens[0].tolist()[:1] == [30] and drafts.chain >= 1


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_a_lookahead_round_has_one_host_sync(target, monkeypatch, temp):
    choose, counts = syncs_per_round(monkeypatch)
    stats = Stats()
    list(generate(target, None, PROMPT, k=choose, max_tokens=30, lookup=True, stats=stats,
                  lookup_by="lookahead:w=3,n=3,g=2", sampling=SamplingParams(temp), seed=1))  # fmt: skip
    trees = [n for n, last in counts[1:] if last.chain is not None]
    assert len(trees) >= 5 and all(n == 1 for n in trees), counts


def test_the_targets_caches_after_lookahead_are_a_plain_ones(target):
    spec_kv, plain_kv, stats = KVState(), KVState(), Stats()
    out = [e.token for e in generate(target, None, PROMPT, k=3, max_tokens=40, lookup=True,
                                     lookup_by="lookahead:w=4,n=4,g=2", kv=spec_kv,
                                     stats=stats)]  # fmt: skip
    plain = [e.token for e in generate(target, None, PROMPT, k=0, max_tokens=40, kv=plain_kv)]
    assert out == plain and stats.accepted > 0 and stats.tree_rounds > 0
    n = len(plain_kv.tokens)
    for a, b in zip(spec_kv.target, plain_kv.target, strict=True):
        assert a.offset == b.offset == n
        assert (abs(a.keys[..., :n, :] - b.keys[..., :n, :]).max() < 1e-4).item()


def test_auto_keeps_the_window_within_the_pass_cost(target):
    """Where a pass costs about as much with 16 more rows (an accelerator's flat curve) auto
    opens its widest window; on a steep curve (this CPU's shape) none, and what it verifies
    is suffix lookup's alone. Both are exact."""
    plain = [e.token for e in generate(target, None, PROMPT, k=0, max_tokens=30)]
    flat, steep = [1.0 + 0.001 * k for k in range(65)], [1.0 + 0.3 * k for k in range(65)]
    for ratio, widest in [(flat, 8), (steep, 0)]:
        chooser = AdaptiveK(cost=CostCurve(pass_ratio=ratio))
        rows = LookaheadRows(Lookup([1]), chooser, LookaheadSize(), 48)
        assert rows._width(0) == widest
        stats = Stats()
        out = [e.token for e in generate(target, None, PROMPT, k=chooser, max_tokens=30,
                                         lookup=True, lookup_by="lookahead", stats=stats)]  # fmt: skip
        assert out == plain


def test_a_target_that_cannot_verify_a_tree(target):
    from families import build

    recurrent = build("qwen3_next", 2, 0, vocab=32)
    with pytest.raises(BadInput, match="lookahead:w=2,n=3,g=2: the target cannot verify a tree"):
        list(generate(recurrent, None, [3, 4, 3], lookup=True, lookup_by="lookahead:w=2,n=3,g=2"))
    stats = Stats()
    out = [e.token for e in generate(recurrent, None, [3, 4, 3], lookup=True, max_tokens=12,
                                     lookup_by="lookahead", stats=stats)]  # fmt: skip
    assert out == [e.token for e in generate(recurrent, None, [3, 4, 3], k=0, max_tokens=12)]
    assert "lookahead needs a tree the target cannot verify" in stats.tree_off


def test_a_sliding_window_target_verifies_the_window(target):
    """Window layers (llama_swa, window 8) take the tree pass: 30 tokens, the same as plain."""
    from families import build

    window = build("llama_swa", 2, 0, vocab=32)
    stats = Stats()
    out = [e.token for e in generate(window, None, [3, 4, 3], lookup=True, max_tokens=30,
                                     lookup_by="lookahead:w=2,n=3,g=2", stats=stats)]  # fmt: skip
    assert out == [e.token for e in generate(window, None, [3, 4, 3], k=0, max_tokens=30)]
    assert stats.tree_rounds > 0 and not stats.tree_off, stats


def test_run_and_serve_with_lookahead(tmp_path, specmlx_home, monkeypatch):
    """`specmlx run --draft lookahead:...` writes what `--draft none` writes; the official
    openai client against `specmlx serve --draft lookahead` gets the plain text, drafted."""
    import openai
    from helpers import Server

    toml = tiny_pair(tmp_path)
    monkeypatch.setenv("SPECMLX_MODELS", str(toml))
    runs = {}
    for draft in ("none", "lookahead:w=2,n=3,g=2"):
        r = CliRunner().invoke(app, ["run", "-n", "24", "--draft", draft, "--temp", "0",
                                     "def add(a, b):"])  # fmt: skip
        assert r.exit_code == 0, r.output
        runs[draft] = r.stdout
    assert runs["none"] == runs["lookahead:w=2,n=3,g=2"]
    env = dict(os.environ, SPECMLX_HOME=str(tmp_path / "home"))
    env["SPECMLX_MODELS"] = str(toml)
    s = Server(env, "--draft", "lookahead:w=2,n=3,g=2", "-q")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        ask = dict(model="t", prompt="def add(a, b):\n", max_tokens=24, temperature=0)
        got = client.completions.create(**ask)
        plain = client.completions.create(**ask, extra_body={"draft": "none"})
        assert got.choices[0].text == plain.choices[0].text
        assert got.model_extra["specmlx"]["drafted"] > 0, got.model_extra
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err
