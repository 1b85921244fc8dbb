"""Cached runs moved to new positions (core/shift.py, serving/prompt_cache.py; `specmlx
serve --cache-reuse N`, llama-server's): the runs found as llama-server finds them, the
rotation exact for every RoPE kind mlx-lm has (a one-layer model, whose cache holds nothing
but the tokens' own keys, gives a fresh prefill's logits; without the rotation, or with
YaRN's input scale twice, it does not), windows that hold what they need and those that do
not, recurrent state and heads refused by name, greedy text from a moved prompt-cache entry,
the approximation past the first layer, and llama.vim's moved cursor over HTTP."""

from __future__ import annotations

import random

import httpx
import mlx.core as mx
import numpy as np
import pytest
from families import build, family_config
from helpers import Server, generate, tiny_pair
from kit_serve import server_env
from mlx_lm.models import llama
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.core.caches import make_caches
from specmlx.core.kvstate import KVState
from specmlx.core.shift import Shifter, Unshiftable, chunks, reused
from specmlx.core.stats import Stats
from specmlx.decoding.engine import prefill
from specmlx.serving.prompt_cache import PromptCache

EXACT = 1e-4  # float32 logits of a moved cache against a fresh prefill's
ROPES = {  # rope_scaling -> the rope module mlx-lm makes of it
    "default": None,  # nn.RoPE
    "linear": {"type": "linear", "factor": 2.0},  # nn.RoPE, scaled positions
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },  # fmt: skip
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 16,
        "short_factor": [1.0] * 4,
        "long_factor": [1.5, 2.0, 3.0, 4.0],
    },  # fmt: skip
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
}


def one_layer(rope_scaling=None, seed: int = 0, layers: int = 1):
    """A tiny llama (head_dim 8, 64 positions) with the given RoPE scaling."""
    config = family_config("llama", layers)
    config.update(rope_scaling=rope_scaling, max_position_embeddings=64, head_dim=8)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def window_last(seed: int = 0):
    """Gemma 3 layers (window 8: sliding, sliding, full, sliding) whose attention writes to
    the residual only in the last, a window layer: every layer's keys and values are then
    functions of each token and its position alone, as in a one-layer model, and the logits
    read the last layer's window."""
    model = build("gemma3_text", 4, seed)
    for layer in model.layers[:-1]:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    mx.eval(model.parameters())
    return model


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 120) for _ in range(n)]


# a prompt, then an edit: the text between P and C is deleted (an editor's window slid)
P, G, C, X, Q = ids(6, 1), ids(9, 2), ids(20, 3), ids(2, 4), ids(3, 5)
OLD, NEW = P + G + C + X, P + C + Q


def feed(model, tokens: list[int], cache) -> mx.array:
    return model(mx.array([tokens], dtype=mx.uint32), cache=cache)


def moved_and_fresh(model, shifter: Shifter | None = None, old=OLD, step: int | None = None):
    """(the new prompt's last logits from the old prompt's caches moved, from a fresh
    prefill): the pieces are P (the common prefix) and C, moved 9 positions back."""
    cache = make_caches(model)
    step = step or len(old)
    for i in range(0, len(old), step):
        feed(model, old[i : i + step], cache)
    pieces = chunks(old, NEW, len(P), 8)
    assert pieces == [(0, 0, len(P)), (len(P) + len(G), len(P), len(C))]
    shifter = shifter or Shifter(model)
    moved = shifter.move([(cache, p) for p in pieces], len(old))
    n = reused(pieces)
    got = feed(model, NEW[n:], moved)
    fresh = feed(model, NEW, make_caches(model))[:, n:]
    return got, fresh


def apart(a: mx.array, b: mx.array) -> float:
    return mx.max(mx.abs(a - b)).item()


# ------------------------------------------------------------------ finding the runs


def test_runs_are_found_as_llama_server_finds_them():
    """llama.cpp PR 9866's illustration, a letter a token: after the common prefix, runs of
    at least N tokens the cache holds further on, in order; an insertion ends the scan."""
    cached = [ord(c) for c in "aaaaabbbbbcccccccdddddeeeeeexffggggghhhhhhhxxxxxxxxx"]
    prompt = [ord(c) for c in "aaaaaccccccceeeeeeffhhhhhhhyyyyyyyy"]
    start = 5  # the common prefix, aaaaa

    def taken(least: int) -> str:
        pieces = chunks(cached, prompt, start, least)
        got = "".join(chr(cached[s + i]) for s, _, n in pieces for i in range(n))
        assert got == "".join(map(chr, prompt[: reused(pieces)]))  # they fill the prompt's start
        return got

    assert taken(0) == "aaaaa"  # --cache-reuse 0: the prefix only
    assert taken(1) == "aaaaaccccccceeeeeeffhhhhhhh"
    assert taken(3) == "aaaaaccccccceeeeee"  # ff is shorter than 3: the scan stops there
    # a run may start a little later: the ff between is prefilled in place
    gapped = chunks(cached, prompt, start, 3, gap=2)
    assert gapped[-1] == (36, 20, 7) and reused(gapped) == 27  # hhhhhhh after ff
    assert chunks(cached, prompt, start, 3, gap=1)[-1] == (22, 12, 6)  # ff + h is too far
    assert chunks([7, 1, 2, 3], [1, 2, 3, 4], 0, 2) == [(1, 0, 3)]  # no common prefix
    assert chunks([1, 2, 3], [1, 2, 3, 4], 3, 2) == [(0, 0, 3)]  # nothing cached past it


# ------------------------------------------------------------------ the rotation


@pytest.mark.parametrize("kind", ROPES)
def test_a_moved_cache_gives_a_fresh_prefills_logits(kind):
    """One layer: a moved cache holds exactly what a fresh prefill of the new prompt holds
    (each key rotated by its move with the layer's own rope), for each RoPE kind. The
    control, the same runs moved without rotating their keys, is far off."""
    model = one_layer(ROPES[kind])
    shifter = Shifter(model)
    assert shifter.refused is None and shifter.turns[0] is not None
    got, fresh = moved_and_fresh(model, shifter)
    assert apart(got, fresh) < EXACT
    shifter.turns = [None]  # the control: moved, not rotated
    got, fresh = moved_and_fresh(model, shifter)
    assert apart(got, fresh) > 1e-2


@pytest.mark.parametrize("kind", ["yarn", "longrope"])
def test_yarn_and_longrope_keys_are_not_scaled_twice(kind):
    """YaRN and LongRoPE scale their input (mscale) before rotating; cached keys carry that
    once, so a move rotates them only. The control rotates with the module as the layer
    calls it, scaling again: its logits are off."""
    model = one_layer(ROPES[kind])
    rope = model.layers[0].self_attn.rope
    shifter = Shifter(model)
    shifter.turns = [lambda k, d: rope(k[..., None, :], offset=d)[..., 0, :]]
    got, fresh = moved_and_fresh(model, shifter)
    assert apart(got, fresh) > 1e-2


def test_window_layers_move_what_they_still_hold():
    """A window layer keeps the last window - 1 (+ slack) moved keys: exact while it holds
    them; once its ring has dropped them the move is refused by name (the prompt cache
    then keeps the common prefix only)."""
    model = window_last()
    got, fresh = moved_and_fresh(model)
    assert apart(got, fresh) < EXACT
    long = OLD + ids(400, 6)  # fed 100 at a time: the window drops C's keys
    with pytest.raises(Unshiftable, match="sliding window of 8 no longer holds"):
        moved_and_fresh(model, old=long, step=100)


def test_past_the_first_layer_a_moved_run_keeps_its_old_context():
    """Why it is asked for, not the default: the first layer's moved keys and values are a
    fresh prefill's, but the next layer's were computed attending to the deleted text."""
    model = one_layer(layers=2)
    cache, fresh = make_caches(model), make_caches(model)
    feed(model, OLD, cache)
    feed(model, NEW[:-1], fresh)
    pieces = chunks(OLD, NEW[:-1], len(P), 8)
    moved = Shifter(model).move([(cache, p) for p in pieces], len(OLD))
    n = reused(pieces)
    first, second = moved
    assert apart(first.keys, fresh[0].keys[..., :n, :]) < EXACT
    assert apart(first.values, fresh[0].values[..., :n, :]) < EXACT
    assert apart(second.keys, fresh[1].keys[..., :n, :]) > 1e-3


def test_runs_after_an_insertion_come_from_another_entry():
    """llama.vim's ring dropped its first chunk and took a new one, and its warm-up filled
    the cache for it: the suggestion's prompt starts with the warm-up's prompt, then the
    window the entry before holds (at another position). One sequence's scan stops at the
    new chunk (an insertion); the runs after it come from the other entry, moved: still a
    fresh prefill's logits."""
    model = one_layer()
    r1, r2, r3, window = ids(15, 11), ids(10, 12), ids(10, 13), ids(20, 14)
    before = r1 + r2 + window + X  # the suggestion before, ring (r1, r2)
    warm = r2 + r3 + [3]  # the warm-up of ring (r2, r3)
    new = r2 + r3 + window + Q
    cache = PromptCache(10**9, 8, model)
    for tokens in (before, warm):
        kv = KVState(target=make_caches(model), tokens=tokens)
        feed(model, tokens, kv.target)
        cache.put(kv)
    got = cache.take(new + [9])
    assert got.tokens == r2 + r3 + window and cache.moved_tokens == len(window)
    logits = feed(model, new[len(got.tokens) :], got.target)
    fresh = feed(model, new, make_caches(model))[:, len(got.tokens) :]
    assert apart(logits, fresh) < EXACT
    assert [e.tokens for e in cache.entries] == [before, warm]  # both used, unchanged


def test_a_few_new_tokens_between_runs_are_prefilled_in_place():
    """Lines typed between two runs (or a run's first token tokenized otherwise, as a
    window's first line without its newline) would end llama-server's scan; up to N/4 of
    them are prefilled in place, and the next run moved after them. The draft model keeps
    what comes before the gap and prefills the rest. One layer: a fresh prefill's logits."""
    target, draft = one_layer(seed=0), one_layer(seed=7)
    c1, c2, typed = C[:10], C[10:], [3, 4]
    old, new = P + G + c1 + c2 + X, P + c1 + typed + c2 + Q
    cache = PromptCache(10**9, 8, target, draft)  # runs of 8, gaps of 2
    kv = cache.take(old + [9])
    list(generate(target, draft, old + [9], k=3, max_tokens=2, kv=kv))
    cache.put(kv)
    got = cache.take(new + [9])
    n = len(P + c1 + typed + c2)
    assert got.tokens == new[:n] and got.draft_held == len(P + c1)
    assert cache.moved_tokens == len(c1) + len(c2)
    logits = feed(target, new[n:], got.target)
    fresh = feed(target, new, make_caches(target))[:, n:]
    assert apart(logits, fresh) < EXACT
    again = cache.take(new + [9])  # (the entries are unchanged: the same again)
    want = [e.token for e in generate(target, draft, new, k=3, max_tokens=8)]
    assert [e.token for e in generate(target, draft, new, k=3, max_tokens=8, kv=again)] == want


# ------------------------------------------------------------------ refused by name


@pytest.mark.parametrize(
    "family, why",
    [
        (
            "qwen3_next",
            "layer 0 holds recurrent state (ArraysCache), a sum over the whole "
            "sequence that no rotation moves",
        ),  # fmt: skip
        ("mamba2", "recurrent state"),
        ("llama4", "ChunkKVCache cannot be moved"),
    ],
)
def test_caches_that_cannot_move_are_refused_by_name(family, why):
    """Recurrent state cannot shift: the prompt cache says why, and keeps serving common
    prefixes as without --cache-reuse."""
    model = build(family, 2, 0)
    cache = PromptCache(10**9, 4, model)
    assert cache.refused is not None and why in cache.refused
    entry = KVState(target=make_caches(model), tokens=[1, 2, 3, 4, 5, 6, 7, 8])
    cache.put(entry)
    got = cache.take(entry.tokens + [9, 9])  # a prompt that extends it is served from it
    assert got.tokens == entry.tokens and cache.moved_tokens == 0


def test_a_head_drafter_keeps_common_prefixes_only():
    class Head:
        reads_hidden = (1,)

    cache = PromptCache(10**9, 4, one_layer(), Head())
    assert "hidden state at every position" in cache.refused


def test_layers_without_rope_are_not_rotated():
    """Cohere 2's global layers apply no RoPE though they hold a rope module: the probe
    finds their keys the same at any position and leaves them unturned."""
    shifter = Shifter(build("cohere2", 2, 0))
    assert shifter.refused is None
    assert [t is not None for t in shifter.turns] == [True, False]


# ------------------------------------------------------------------ through the engine


@pytest.mark.parametrize("which", ["one layer", "window last"])
def test_greedy_text_from_a_moved_prompt_cache_entry_is_a_fresh_ones(which):
    """The prompt cache moves the old prompt's runs to where the new prompt has them, the
    draft model's too; the engine then prefills only the rest, and greedy speculation from
    there gives the text a fresh prefill gives."""
    make = one_layer if which == "one layer" else window_last
    target, draft = make(seed=0), make(seed=7)
    cache = PromptCache(10**9, 8, target, draft)
    assert cache.refused is None
    old = cache.take(OLD + [9])
    list(generate(target, draft, OLD + [9], k=3, max_tokens=4, kv=old))
    cache.put(old)
    kv = cache.take(NEW)
    n = len(P) + len(C)
    assert kv.tokens == NEW[:n] and kv.draft_held == n and cache.moved_tokens == len(C)
    stats = Stats()
    got = [e.token for e in generate(target, draft, NEW, k=3, max_tokens=12, kv=kv, stats=stats)]
    want = [e.token for e in generate(target, draft, NEW, k=3, max_tokens=12)]
    assert got == want and stats.cached_tokens == n
    # the entry it came from is still there, unchanged
    assert any(e.tokens[: len(OLD)] == OLD for e in cache.entries)


def test_a_run_to_the_entrys_end_moves_as_python_ints_and_a_tree_round_follows():
    """llama.vim's follow-up after a Tab (issue 63): the moved run reached the end of what
    the entry held, its length came out of numpy as an int64, became the caches' offset,
    and the next tree round failed in mx.array ("Invalid type int64"). Pieces are Python
    ints where they are made, a piece that is not is refused where it enters a cache, and
    the tree round after the move keeps the target's greedy text."""
    old, new = P + G + C + [9], P + C + X
    pieces = chunks(old[:-1], new[:-1], len(P), 8)
    assert pieces[-1][0] + pieces[-1][2] == len(old) - 1  # the run reaches the entry's end
    assert all(type(x) is int for p in pieces for x in p), pieces
    target, draft = one_layer(seed=0), one_layer(seed=7)
    numpy_piece = (np.int64(0), 0, np.int64(len(P)))
    with pytest.raises(TypeError, match="Python ints"):
        Shifter(target).move([(make_caches(target), numpy_piece)], len(P))
    cache = PromptCache(10**9, 8, target, draft)
    entry = cache.take(old)
    prefill(target, draft, old, kv=entry)  # (an editor's warm-up: the prompt, nothing made)
    cache.put(entry)
    kv = cache.take(new)
    assert len(kv.tokens) == len(P) + len(C) and all(type(c.offset) is int for c in kv.target)
    stats = Stats()
    got = [e.token for e in generate(target, draft, new, k=3, max_tokens=12, kv=kv,
                                     tree="8", stats=stats)]  # fmt: skip
    assert stats.tree_rounds > 0
    assert got == [e.token for e in generate(target, None, new, max_tokens=12)]


# ------------------------------------------------------------------ llama.vim over HTTP

LINES = [f"    value_{i} = compute({i}, scale)\n" for i in range(120)]


def vim_request(row: int) -> dict:
    """llama.vim's FIM request with the cursor inside ``row``: 40 lines before, the line's
    start typed, 10 lines after, one chunk of another file."""
    typed = LINES[row][:10]
    return {
        "input_prefix": "".join(LINES[row - 40 : row]), "prompt": typed,
        "input_suffix": LINES[row][10:] + "".join(LINES[row + 1 : row + 11]),
        "input_extra": [{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"}],
        "n_predict": 4, "temperature": 0, "cache_prompt": True, "samplers": ["top_k", "infill"],
        "response_fields": ["content", "tokens_cached", "timings/prompt_n"],
    }  # fmt: skip


def test_a_moved_cursor_reuses_the_window_it_had(tmp_path):
    """The cursor moves two lines down: the window before it slid, so a server reusing
    common prefixes only prefills it again from its start (the control); with --cache-reuse
    the 38 lines both windows hold come from the cache, moved."""
    toml = tiny_pair(tmp_path, fim=True)
    cached = {}
    for reuse in ("0", "16"):
        s = Server(server_env(tmp_path, toml), "-q", "--cache-reuse", reuse)
        try:
            first = httpx.post(s.url + "/infill", json=vim_request(60), timeout=120).json()
            moved = httpx.post(s.url + "/infill", json=vim_request(62), timeout=120).json()
        finally:
            code, err = s.stop()
        assert code == 0 and "Traceback" not in err, err
        assert first["tokens_cached"] == 0 and "content" in moved
        cached[reuse] = moved["tokens_cached"], moved["timings/prompt_n"]
    (kept, prefilled), (kept_moved, prefilled_moved) = cached["0"], cached["16"]
    assert kept_moved > 10 * kept and prefilled_moved < prefilled / 3, cached


def test_a_negative_cache_reuse_is_a_usage_error(tmp_path):
    env = server_env(tmp_path, tiny_pair(tmp_path))
    r = CliRunner().invoke(app, ["serve", "--cache-reuse", "-1"], env=env)
    assert r.exit_code == 2 and r.output.strip() == "error: --cache-reuse must be >= 0, got -1"
