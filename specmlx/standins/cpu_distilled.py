"""The distilled CPU pair's draft (`specmlx models build cpu-distilled`): the run's settings,
its expected time, and where it goes."""

from __future__ import annotations

from pathlib import Path

from ..distill.train import DistillConfig
from ..paths import specmlx_home

# `specmlx models build cpu-distilled`: a 4-block student of SmolLM2-135M on the standard
# library's source: 32768 labelled tokens, 120 steps of 4 x 256, sized to build in about
# 20 minutes on a 2-core x86 CPU. CPU_RATES are the rounded rates measured there (tokens/s
# of the teacher's labelling and of a student step; BENCHMARKS.md, "A distilled draft"):
# they only size the time the build announces.
CPU_DISTILLED = DistillConfig(
    layers=4, steps=120, batch=4, seq_len=256, data_tokens=32768, heldout_tokens=1024,
    lr=5e-4, warmup=10, eval_every=20, save_every=20,
)  # fmt: skip
CPU_RATES = {"teacher_tokens_per_s": 100.0, "student_tokens_per_s": 130.0}


def cost_seconds(config: DistillConfig, rates: dict[str, float]) -> float:
    """A run's time from its sizes and measured rates: labelled tokens / teacher rate +
    steps x batch x seq_len / student-step rate (evaluations not counted)."""
    teacher = config.data_tokens / rates["teacher_tokens_per_s"]
    return teacher + config.steps * config.batch * config.seq_len / rates["student_tokens_per_s"]


def distilled_dir() -> Path:
    """Where `specmlx models build cpu-distilled` puts its draft."""
    return specmlx_home() / "cpu-distilled" / "draft"
