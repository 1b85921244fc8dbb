"""Held-out acceptance of the distilled CPU pair's draft against the untrained student
(the same picked blocks, no training) and the 4-bit copy (cpu-demo-draft), all against
SmolLM2-135M (the demo target's logits), teacher-forced on the held-out rows that
`specmlx models build cpu-distilled` never trained on.

    greedy  = P(argmax q == argmax p)             (what greedy speculation accepts per token)
    alpha_T = E[sum_x min(p_T(x), q_T(x))]        (what sampling at temperature T accepts)

Run: .venv/bin/python experiments/distill_accept.py   (after `specmlx models build cpu-distilled`)
"""

from __future__ import annotations

import mlx.core as mx

from specmlx.distill.student import make_student, read_data
from specmlx.models.loading import load_model
from specmlx.models.registry import load_registry
from specmlx.standins.cpu_distilled import CPU_DISTILLED, distilled_dir


def rates(logits_p: mx.array, logits_q: mx.array) -> dict[str, float]:
    out = {"greedy": mx.mean(mx.argmax(logits_p, -1) == mx.argmax(logits_q, -1)).item()}
    for t in (1.0, 0.8):
        p, q = mx.softmax(logits_p / t, -1), mx.softmax(logits_q / t, -1)
        out[f"alpha_{t:g}"] = mx.mean(mx.sum(mx.minimum(p, q), -1)).item()
    return out


def main() -> None:
    reg = load_registry()
    teacher = load_model(reg.resolve("smollm2-135m"))
    teacher.model.set_dtype(mx.float32)
    _, held = read_data("stdlib", teacher.tokenizer, CPU_DISTILLED)
    drafts = {
        "untrained (blocks 0, 10, 19, 29 as picked)": make_student(teacher, CPU_DISTILLED)[0],
        "distilled (cpu-distilled-draft)": load_model(reg.resolve(str(distilled_dir()))).model,
        "4-bit copy (cpu-demo-draft)": load_model(reg.resolve("cpu-demo-draft")).model,
    }
    totals = {name: {} for name in drafts}
    for row in held:
        x = mx.array(row[None])
        p = teacher.model(x).astype(mx.float32)
        for name, model in drafts.items():
            for key, value in rates(p, model(x).astype(mx.float32)).items():
                totals[name][key] = totals[name].get(key, 0.0) + value / len(held)
    print(f"held-out: {held.size} tokens of {len(held)} rows (files the build never read)\n")
    print("| draft | greedy agreement | alpha, T = 1 | alpha, T = 0.8 |")
    print("|---|---|---|---|")
    for name, r in totals.items():
        print(f"| {name} | {r['greedy']:.1%} | {r['alpha_1']:.1%} | {r['alpha_0.8']:.1%} |")


if __name__ == "__main__":
    main()
