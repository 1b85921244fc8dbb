"""Plain decoding through specmlx's caches against mlx-lm's own, side by side: tokens per
second of the same decode loop (mlx-lm generate_step's shape: the next step queued before
the current token is read) on random-weight models, the two cache kinds interleaved.

    .venv/bin/python experiments/cache_decode.py [--tokens 256] [--reps 5] [--only gemma3]
"""

from __future__ import annotations

import argparse
import importlib
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from specmlx.core.caches import cache_kinds, make_caches
from specmlx.machine import blas_in_use

SHAPES = {
    "gemma3_text (window 128, 1152 wide, 6 layers)": dict(
        model_type="gemma3_text", hidden_size=1152, num_hidden_layers=6, intermediate_size=6912,
        num_attention_heads=4, head_dim=256, num_key_value_heads=1, vocab_size=32000,
        sliding_window=128, sliding_window_pattern=6,
    ),
    "gpt_oss (window 128, 4 experts, 4 layers)": dict(
        model_type="gpt_oss", num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
        vocab_size=32000, hidden_size=1024, intermediate_size=1024, head_dim=64,
        num_attention_heads=16, num_key_value_heads=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "mamba2 (2048 wide, 4 layers)": dict(
        model_type="mamba2", num_heads=64, head_dim=64, vocab_size=32000, hidden_size=2048,
        intermediate_size=4096, state_size=128, num_hidden_layers=4, layer_norm_epsilon=1e-5,
        conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True,
        tie_word_embeddings=True, time_step_limit=(0.0, 100.0), time_step_rank=128,
    ),
}  # fmt: skip


def decode(model, cache, prompt: mx.array, n: int) -> tuple[list[int], float]:
    """Greedy decoding of n tokens after ``prompt``; returns the tokens and the seconds."""
    model(prompt[:, :-1], cache=cache)
    mx.eval([c.state for c in cache])

    def step(y):
        return mx.argmax(model(y.reshape(1, -1), cache=cache)[0, -1], axis=-1)

    t0 = time.perf_counter()
    y = step(prompt[:, -1:])
    mx.async_eval(y)
    out = []
    for _ in range(n):
        nxt = step(y)
        mx.async_eval(nxt)
        out.append(y.item())
        y = nxt
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="run the models whose name starts with this")
    a = ap.parse_args()
    mx.random.seed(0)
    print(f"BLAS: {blas_in_use()}; MLX {mx.__version__}, device {mx.default_device()}")
    print(f"greedy decoding of {a.tokens} tokens after a 64-token prompt, best of {a.reps}\n")
    for name, config in SHAPES.items():
        if not name.startswith(a.only):
            continue
        module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
        model = module.Model(module.ModelArgs.from_dict(config))
        mx.eval(model.parameters())
        prompt = mx.random.randint(0, 32000, (1, 64)).astype(mx.uint32)
        best = {"specmlx": float("inf"), "mlx-lm": float("inf")}
        outs = {}
        for _ in range(a.reps):
            for who, make in (("specmlx", make_caches), ("mlx-lm", make_prompt_cache)):
                out, secs = decode(model, make(model), prompt, a.tokens)
                best[who], outs[who] = min(best[who], secs), out
        kinds = cache_kinds(make_caches(model))
        same = "token-identical" if outs["specmlx"] == outs["mlx-lm"] else "DIFFERENT tokens"
        ratio = best["mlx-lm"] / best["specmlx"]
        print(f"{name:48} {kinds}: specmlx {a.tokens / best['specmlx']:.1f} tok/s, "
              f"mlx-lm {a.tokens / best['mlx-lm']:.1f} tok/s, ratio {ratio:.3f}, {same}")  # fmt: skip


if __name__ == "__main__":
    main()
