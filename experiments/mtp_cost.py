"""What one MTP head step costs against one target decoding step, on random weights at real
layer shapes (mlx-lm's own classes): the head is one full-attention decoder layer, its fc
(2H -> H) and the target's LM head; the target is every layer and the same LM head.

Both after 256 tokens of context, best of --reps single-token steps, float32 on whatever
device MLX uses (on a Linux CPU preload OpenBLAS: scripts/env.sh).

    .venv/bin/python experiments/mtp_cost.py [--layers 24] [--reps 5]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm.models import qwen3_5
from rollback_cost import best  # experiments/: the same timing rule

from specmlx.core.caches import make_caches
from specmlx.core.hidden import HiddenTap
from specmlx.drafting.heads.mtp import MTPHead
from specmlx.machine import blas_in_use


def shape(layers: int) -> dict:
    # Qwen3.5-2B-like layers (gated delta 3 of 4, full attention the 4th) and Qwen3's
    # 151,936-id vocabulary; the layer count is the target's depth
    return dict(
        model_type="qwen3_5", text_config=dict(
            model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144,
            num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
            head_dim=256, vocab_size=151936, linear_num_value_heads=16,
            linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=True,
        ),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    target = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(shape(a.layers)))
    mx.eval(target.parameters())
    tap = HiddenTap(target)
    head = MTPHead(target, "qwen3_5")
    mx.eval(head.parameters())
    ids = mx.random.randint(0, 1000, (1, 256)).astype(mx.uint32)
    tcache, hcache = make_caches(target), head.make_cache()
    with tap:
        mx.eval(target(ids, cache=tcache))
    h = tap.final()
    mx.eval(head(h[:, :-1], ids[:, 1:], hcache))
    one, h1 = ids[:, :1], h[:, -1:]

    def target_step():
        mx.eval(target(one, cache=tcache))
        for c in tcache:  # give the token back: every step sees the same context length
            if hasattr(c, "offset") and not hasattr(c, "cache"):
                c.trim(1)

    def head_step():
        mx.eval(head(h1, one, hcache))
        hcache[0].trim(1)

    t_target, t_head = best(target_step, a.reps), best(head_step, a.reps)
    print(f"BLAS: {blas_in_use()}; {a.layers} target layers, hidden 2048, vocab 151936")
    print(f"target step {t_target * 1e3:.1f} ms, head step {t_head * 1e3:.1f} ms: "
          f"head/target = {t_head / t_target:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
