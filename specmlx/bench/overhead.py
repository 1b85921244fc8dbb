"""The host's share of a token: specmlx against mlx-lm on a model too small to hide it.

A tiny random Llama (a 32,000-id vocabulary, two narrow layers) is both target and draft, so
a forward pass costs next to nothing and what a token costs is mostly Python and graph
building: the engine's bookkeeping per round. Both tools generate the same greedy tokens
(every draft is accepted: the draft is the target), interleaved within each repeat, and the
figure is specmlx's time per token over mlx-lm's, paired repeat by repeat (median), and the
ratio of each tool's best repeat (as `timeit` advises: a busy neighbour only ever adds time,
so the fastest repeat is the closest to a quiet machine). Below 1 means less host work per
token than mlx-lm. It is a guard for reshaping the engine, not a
speed claim: on a real model the forward passes dominate.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models import llama

from ..decoding.engine import Decode, generate_tokens
from ..drafting.choosing.choosers import K

VOCAB = 32000
KS = (0, 2, 4)


@dataclass(frozen=True)
class OverheadRow:
    """One k: median seconds per token of each tool and their paired median ratio."""

    k: int
    specmlx_s: float  # median seconds per generated token
    mlx_lm_s: float
    ratio: float  # median over repeats of specmlx_s / mlx_lm_s (same repeat)
    best_ratio: float  # specmlx's fastest repeat over mlx-lm's fastest
    identical: bool  # specmlx and mlx-lm emitted the same tokens in every repeat


def tiny_llama(seed: int = 0) -> llama.Model:
    """The random model both tools run: V = 32000, hidden 64, two layers."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _specmlx(model, prompt: list[int], k: int, n: int) -> Iterator[int]:
    for e in generate_tokens(model, model if k else None, prompt, Decode(k=K(k), max_tokens=n)):
        yield e.token


def _mlx_lm(model, prompt: list[int], k: int, n: int) -> Iterator[int]:
    x = mx.array(prompt, dtype=mx.uint32)
    greedy = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    if k == 0:
        for tok, _ in generate_step(x, model, max_tokens=n, sampler=greedy):
            yield int(tok)
        return
    steps = speculative_generate_step(
        x, model, model, num_draft_tokens=k, max_tokens=n, sampler=greedy
    )
    for tok, _, _ in steps:
        yield int(tok)


def _per_token(tokens: Iterator[int]) -> tuple[list[int], float]:
    """Seconds per token after the first (prefill and the first pass excluded)."""
    out = [next(tokens)]
    t0 = time.perf_counter()
    out += list(tokens)
    return out, (time.perf_counter() - t0) / max(len(out) - 1, 1)


def measure(
    *,
    tokens: int = 256,
    repeats: int = 5,
    ks: tuple[int, ...] = KS,
    on_step: Callable[[str], None] | None = None,
) -> list[OverheadRow]:
    """Time specmlx and mlx-lm per token on the tiny model, side by side.

    tokens: tokens per generation; repeats: interleaved repeats (the first run of each is a
    warm-up, not counted); ks: draft lengths (0: plain decoding); on_step: called with a
    label before each timed generation (progress)."""
    model = tiny_llama()
    prompt = list(range(1, 33))
    tools = {"specmlx": _specmlx, "mlx-lm": _mlx_lm}
    for fn in tools.values():  # warm-up: compile paths, fault in weights
        for k in ks:
            list(fn(model, prompt, k, 16))
    times: dict[tuple[str, int], list[float]] = {}
    outs: dict[tuple[str, int], list[list[int]]] = {}
    for rep in range(repeats):
        for k in ks:
            for name, fn in tools.items():
                if on_step:
                    on_step(f"{name} k={k} ({rep + 1}/{repeats})")
                out, s = _per_token(fn(model, prompt, k, tokens))
                times.setdefault((name, k), []).append(s)
                outs.setdefault((name, k), []).append(out)
    rows = []
    for k in ks:
        a, b = times[("specmlx", k)], times[("mlx-lm", k)]
        rows.append(
            OverheadRow(
                k=k,
                specmlx_s=statistics.median(a),
                mlx_lm_s=statistics.median(b),
                ratio=statistics.median(x / y for x, y in zip(a, b, strict=True)),
                best_ratio=min(a) / min(b),
                identical=outs[("specmlx", k)] == outs[("mlx-lm", k)],
            )
        )
    return rows
