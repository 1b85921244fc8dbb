"""What a rollback costs, as a fraction of the verify pass it follows, per cache kind, on
random-weight models at real layer shapes (mlx-lm's own classes; a few layers of each).

For each model: prefill 256 tokens, then time (best of --reps) a verify pass over k + 1
tokens, and the rollback that keeps m of them: a trim (attention, sliding window), the
recurrence recomputed from the recorded pass (specmlx/core/recurrent.py), and the generic replay
of the m tokens through the whole model (what other recurrent families get).

    .venv/bin/python experiments/rollback_cost.py [--k 4] [--keep 2] [--reps 5]
"""

from __future__ import annotations

import argparse
import importlib
import time
from contextlib import nullcontext

import mlx.core as mx

from specmlx.core.caches import make_caches, recurrent_layers, restore, snapshot, trim
from specmlx.core.recurrent import PassRecorder
from specmlx.machine import blas_in_use

# real layer shapes, fewer layers: per layer, the costs scale alike
SHAPES = {
    "gemma3_text (Gemma 3 4B layers, window 1024)": dict(
        model_type="gemma3_text", hidden_size=2560, num_hidden_layers=6, intermediate_size=10240,
        num_attention_heads=8, head_dim=256, num_key_value_heads=4, vocab_size=32000,
        sliding_window=1024, sliding_window_pattern=6,
    ),
    "qwen3_5 (Qwen3.5 2B-like layers: gated delta 3 of 4)": dict(
        model_type="qwen3_5", text_config=dict(
            model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
            vocab_size=32000, linear_num_value_heads=16, linear_num_key_heads=16,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            full_attention_interval=4,
        ),
    ),
    "mamba2 (Mamba2 1.3B layers)": dict(
        model_type="mamba2", num_heads=64, head_dim=64, vocab_size=32000, hidden_size=2048,
        intermediate_size=4096, state_size=128, num_hidden_layers=4, layer_norm_epsilon=1e-5,
        conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True,
        tie_word_embeddings=True, time_step_limit=(0.0, 100.0), time_step_rank=128,
    ),
    "nemotron_h (Nemotron-H 8B-like layers: M*M-)": dict(
        model_type="nemotron_h", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        max_position_embeddings=4096, num_attention_heads=32, num_key_value_heads=8,
        attention_bias=False, mamba_num_heads=128, mamba_head_dim=64, mamba_proj_bias=False,
        ssm_state_size=128, conv_kernel=4, n_groups=8, mlp_bias=False,
        layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern=list("M*M-"), head_dim=128, time_step_limit=(0.0, 100.0),
    ),
}  # fmt: skip


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def measure(config: dict, k: int, keep: int, reps: int) -> dict:
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    ids = mx.random.randint(0, 32000, (1, 256)).astype(mx.uint32)
    draft = mx.random.randint(0, 32000, (1, k + 1)).astype(mx.uint32)
    cache = make_caches(model)
    mx.eval(model(ids, cache=cache))
    held = 256
    layers = recurrent_layers(cache)
    recorder = PassRecorder(model, layers) if layers else None

    def verify():
        snap = snapshot(cache, held)
        with recorder.recording(k + 1) if recorder else nullcontext():
            mx.eval(model(draft, cache=cache))
        return snap

    def undo(snap):  # back to the state before the pass, untimed
        restore(cache, snap, held + k + 1)
        mx.eval([c.state for c in cache])

    out = {"verify_s": best(lambda: undo(verify()), reps)}
    if not layers:
        snaps = []

        def trimmed():
            snaps.append(verify())
            t0 = time.perf_counter()
            trim(cache, k + 1 - keep)
            mx.eval([c.state for c in cache])
            dt = time.perf_counter() - t0
            cache_offset = held + keep
            restore(cache, snaps[-1], cache_offset)
            return dt

        out["trim_s"] = min(trimmed() for _ in range(reps))
        return out

    def timed(way):
        snap = verify()
        t0 = time.perf_counter()
        if way == "recorded":
            assert recorder.settle(keep, snap.recurrent)
            trim(cache, k + 1 - keep, recurrent=False)
        else:
            restore(cache, snap, held + k + 1)
            model(draft[:, :keep], cache=cache)
        mx.eval([c.state for c in cache])
        dt = time.perf_counter() - t0
        restore(cache, snap, held + keep)
        mx.eval([c.state for c in cache])
        return dt

    if recorder.supported:
        out["recorded_s"] = min(timed("recorded") for _ in range(reps))
    out["replay_s"] = min(timed("replay") for _ in range(reps))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4, help="drafts verified (the pass feeds k + 1)")
    ap.add_argument("--keep", type=int, default=2, help="tokens of the pass kept")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    mx.random.seed(0)
    print(f"BLAS: {blas_in_use()}; MLX {mx.__version__}, device {mx.default_device()}")
    print(f"verify pass over {a.k + 1} tokens after 256; rollback keeps {a.keep} of them\n")
    print(f"{'model':56} {'verify':>9} {'rollback':>24}")
    for name, config in SHAPES.items():
        r = measure(config, a.k, a.keep, a.reps)
        v = r["verify_s"]
        parts = [f"{w} {r[f'{w}_s'] * 1e3:.2f} ms = {r[f'{w}_s'] / v:.1%}"
                 for w in ("trim", "recorded", "replay") if f"{w}_s" in r]  # fmt: skip
        print(f"{name:56} {v * 1e3:7.1f} ms   " + ";  ".join(parts))


if __name__ == "__main__":
    main()
