"""The mlx-lm families outside the big matrix (tests/test_families.py): no family is silently
inexact. Each module of the installed mlx-lm whose caches are not plain KVCache is listed
here or there; each listed family is exact (plain decoding through specmlx's caches computes
what mlx-lm's do, and greedy speculation is token-identical to plain decoding) or refused by
name (an IncompatiblePair naming its cache class).
"""

import importlib.util
import re
from pathlib import Path

import mlx.core as mx
import pytest
from families import FAMILIES, OUTSIDE, WINDOW, build, family_config, noisy_copy
from helpers import generate, save_tiny, tiny_tokenizer
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from specmlx.core import caches
from specmlx.core.caches import cache_kinds, check_kinds, make_caches
from specmlx.core.stats import Stats
from specmlx.errors import IncompatiblePair, RollbackError
from specmlx.models.footprint import layer_kinds
from specmlx.models.loading import load_pair
from specmlx.models.registry import load_registry

SHORT = [5, 9, 2]  # inside every window
LONG = list(range(1, 4 * WINDOW + 3))  # past every window several times over
LAYERS, SCALE, NOISE = 4, 2.0, 0.05
MAX_TOKENS = 24

# a module that uses a cache other than KVCache (or makes another module's caches)
SPECIAL = re.compile(
    r"RotatingKVCache|ArraysCache|ChunkedKVCache|CacheList|class \w*Cache\b"
    r"|def make_cache\(self[^)]*\)[^:]*:\s*return self\.[\w.]+\.make_cache\(\)"
)
# modules that are no family of their own: mlx-lm's cache module itself, and multimodal
# wrappers whose make_cache is their text model's (that family is in the matrix)
NOT_FAMILIES = {"cache": "mlx-lm's cache classes themselves"}
WRAPPERS = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "lfm2-vl": "lfm2"}
# families whose tiny model cannot be built here: module -> why
UNBUILT: dict[str, str] = {}
# families specmlx refuses to speculate with: module -> the cache class the refusal names
REFUSED = {"deepseek_v41": "LayerCache", "plamo3": "BatchDependentRotatingKVCache"}
# families that cannot run on MLX's CPU backend: module -> why
METAL_ONLY = {
    "muse_spark": "its attention calls mlx_lm.kernels.qk_norm_rope, a Metal kernel",
}
_pairs: dict = {}


def pair(family):
    if family not in _pairs:
        _pairs[family] = (
            build(family, LAYERS, 0, SCALE),
            noisy_copy(family, LAYERS, 0, NOISE, SCALE),
        )
    return _pairs[family]


def tokens(target, draft, prompt, stats=None, **kw):
    events = generate(target, draft, prompt, max_tokens=MAX_TOKENS, stats=stats, **kw)
    return [e.token for e in events]


def _models_dir() -> Path:
    return Path(importlib.util.find_spec("mlx_lm.models").origin).parent


def test_every_mlx_lm_family_with_a_special_cache_is_listed():
    """A new mlx-lm family (or a patch giving an old one a new cache) fails here until
    someone adds it to FAMILIES or OUTSIDE (tests/families.py), or to UNBUILT with a reason."""
    special = sorted(p.stem for p in _models_dir().glob("*.py") if SPECIAL.search(p.read_text()))
    assert len(special) > 40, special  # the pattern still finds what it found in mlx-lm 0.32
    listed = FAMILIES.keys() | OUTSIDE.keys() | UNBUILT.keys() | WRAPPERS.keys()
    assert [m for m in special if m not in listed | NOT_FAMILIES.keys()] == []
    assert set(WRAPPERS.values()) <= FAMILIES.keys()
    assert not (OUTSIDE.keys() & FAMILIES.keys()) and not (UNBUILT.keys() & OUTSIDE.keys())


@pytest.mark.parametrize("family", list(OUTSIDE))
def test_each_outside_family_brings_the_cache_kind_it_is_listed_with(family):
    target = build(family, LAYERS, 0, SCALE)
    kinds = set(cache_kinds(make_caches(target)))
    kind = OUTSIDE[family][1]
    if kind == "recurrent":
        assert "ArraysCache" in kinds, kinds
    elif kind == "window":
        assert kinds - {"KVCache", "ArraysCache"}, kinds
    else:
        assert kinds == {"KVCache"}, kinds
    if family in REFUSED:
        with pytest.raises(IncompatiblePair, match=f"{REFUSED[family]} layer cache"):
            check_kinds(make_caches(target))


def _marks(family):
    if family in METAL_ONLY:
        return [pytest.mark.skipif(not mx.metal.is_available(), reason=METAL_ONLY[family])]
    return []


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=_marks(f)) for f in OUTSIDE if f not in REFUSED]
)
def test_each_outside_family_is_exact(family):
    target, draft = pair(family)
    check_kinds(make_caches(target))  # not refused
    ours, theirs = make_caches(target), make_prompt_cache(target)
    if cache_kinds(ours) != cache_kinds(theirs):
        # plain decoding through specmlx's window and chunk caches computes what mlx-lm's
        # caches do (the rest are mlx-lm's own caches, unchanged)
        for cache in (ours, theirs):
            target(mx.array([LONG[:3]]), cache=cache)
        for t in LONG[3:]:
            a, b = (target(mx.array([[t]]), cache=c)[0, -1] for c in (ours, theirs))
            assert mx.allclose(a, b, atol=1e-4, rtol=1e-4), t
            assert mx.argmax(a).item() == mx.argmax(b).item()
    partial = 0  # rounds that kept some drafts and rejected others: the rollbacks that matter
    # k = 8 gives back up to 8 tokens, a whole window: on the long prompt, where the windows
    # have filled (the recurrent and full families' rollbacks do not depend on k; time)
    wide = [(8, False)] if OUTSIDE[family][1] == "window" else []
    for prompt in (SHORT, LONG):
        plain = tokens(target, None, prompt, k=0)
        runs = [(3, False), (3, True)] + (wide if prompt is LONG else [])
        for k, lookup in runs:
            stats = Stats()
            spec = tokens(target, draft, prompt, stats, k=k, lookup=lookup)
            assert spec == plain, (k, lookup, prompt[:4])
            partial += sum(stats.accept_hist[1:k])
    assert partial > 0, "no round kept part of its drafts: the test would not see a bad trim"


@pytest.mark.parametrize("family", list(REFUSED))
def test_a_refused_outside_family_is_refused_by_its_cache_class(family):
    target, draft = pair(family)
    with pytest.raises(IncompatiblePair, match=f"target's {REFUSED[family]} layer cache"):
        tokens(target, draft, SHORT, k=3)


def test_a_chunk_cache_gives_back_what_the_next_chunk_needs_and_refuses_more():
    """Llama 4's chunked layers with a slack of 1 (chunk 8): after one-token steps have dropped
    keys, every rollback the trim rule allows gives the next token the logits of a cache that
    never drops a key, and the rollbacks it refuses (asking for keys already gone) would not."""
    target = build("llama4", LAYERS, 0, SCALE)
    prompt, steps = LONG[:13], LONG[13:18]
    allowed, refused = [], []
    for n in range(13):
        ours, full = make_caches(target, slack=1), make_caches(target, slack=10_000)
        for cache in (ours, full):
            target(mx.array([prompt]), cache=cache)
            for t in steps:
                target(mx.array([[t]]), cache=cache)
        if caches.can_rollback(ours, n):
            caches.trim(ours, n)
            allowed.append(n)
        else:
            with pytest.raises(RollbackError):
                caches.trim(ours, n)
            for c in caches.layer_caches(ours):  # what a trim without the check would do
                c.trim(n)
            refused.append(n)
        caches.trim(full, n)
        a, b = (target(mx.array([[3]]), cache=c)[0, -1] for c in (ours, full))
        same = mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()
        assert same == (n in allowed), (n, mx.abs(a - b).max().item())
    # 18 tokens held from position 8 on: back to position 8 is exact, to 7 needs key 0
    assert allowed == list(range(11)) and refused == [11, 12]


def test_a_batch_dependent_family_still_decodes_plainly_and_is_refused_at_load(tmp_path):
    """plamo3: plain decoding runs on mlx-lm's own caches and gives mlx-lm's tokens; a pair
    with it is refused when it loads, naming the cache class, before any generation."""
    target = build("plamo3", LAYERS, 0, SCALE)
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    theirs = [int(t) for t, _ in generate_step(mx.array(LONG), target, max_tokens=MAX_TOKENS,
                                               sampler=greedy)]  # fmt: skip
    assert tokens(target, None, LONG, k=0) == theirs
    path = save_tiny(tmp_path / "p3", family_config("plamo3", 2), tiny_tokenizer(), seed=0)
    toml = tmp_path / "models.toml"
    toml.write_text(f'[models.p3]\nsource = "local:{path}"\n')
    with pytest.raises(IncompatiblePair, match="target's BatchDependentRotatingKVCache"):
        load_pair("p3", "p3", registry=load_registry([toml]), context=64)


@pytest.mark.parametrize("family", ["llama4", "gemma3n"])
def test_the_memory_plan_reads_chunked_and_kv_shared_layers(family):
    """footprint.layer_kinds names each cache these make: Llama 4's chunks as windows, Gemma
    3n's KV-shared layers as holding none of their own."""
    names = {"KVCache": "full", "WindowKVCache": "window", "ChunkKVCache": "window"}
    made = [names[type(c).__name__] for c in make_caches(build(family, LAYERS, 0, SCALE))]
    kinds = layer_kinds(family_config(family, LAYERS))
    assert [k for k in kinds if k != "none"] == made
    assert "window" in made and ("none" in kinds) == (family == "gemma3n")
