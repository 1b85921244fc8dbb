"""Run under mlx.launch (experiments/bench-distributed does): how many all-reduces one target
pass of a tensor-parallel llama makes, and what one all-reduce of a pass's size costs here.

Prints one JSON line on rank 0.
"""

from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
from mlx_lm.models import llama


def main() -> None:
    group = mx.distributed.init()
    # the count depends on the layers only: a narrow random llama with as many layers; the
    # payload of each all-reduce is (1, tokens, hidden) of the real model
    layers, hidden = int(sys.argv[1]), int(sys.argv[2])
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=layers,
        intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
        rms_norm_eps=1e-5, vocab_size=256,
    )  # fmt: skip
    mx.random.seed(0)
    model = llama.Model(args)
    model.shard(group)
    mx.eval(model.parameters())
    calls = []
    real = mx.distributed.all_sum

    def counting(x, *a, **kw):
        calls.append(x.shape)
        return real(x, *a, **kw)

    mx.distributed.all_sum = counting
    mx.eval(model(mx.array([[1, 2, 3, 4, 5]])))
    mx.distributed.all_sum = real
    per_pass = len(calls)
    # one all-reduce of what a verify pass over k + 1 = 5 tokens sends: (1, 5, hidden)
    out = {"world": group.size(), "layers": layers, "all_reduces_per_pass": per_pass}
    for tokens in (1, 5, 9):
        x = mx.ones((1, tokens, hidden), dtype=mx.float32)
        mx.eval(real(x))
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            mx.eval(real(x))
            times.append(time.perf_counter() - t0)
        times.sort()
        out[f"us_{tokens}_tokens"] = {
            "median": times[len(times) // 2] * 1e6,
            "p10": times[len(times) // 10] * 1e6,
            "bytes": x.nbytes,
        }
    if group.rank() == 0:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
