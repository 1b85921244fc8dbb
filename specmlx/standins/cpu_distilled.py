"""The CPU stand-ins trained by distillation: the distilled pair's draft (`specmlx models
build cpu-distilled`) and an EAGLE-3 head for the demo target (`specmlx models build
cpu-eagle3`): each run's settings, its expected time, and where it goes."""

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


# `specmlx models build cpu-eagle3`: an EAGLE-3 head over the demo target (cpu-demo-target,
# whose features it reads), trained on the standard library's source: 16384 tokens labelled
# with the target's features at layers 1, 14 and 26, then 360 steps of 4 x 256 unrolled 3
# steps deep, sized to build in about 25 minutes on a 2-core x86 CPU. It is 576 wide, the
# width the stand-in's hidden states really have (the widening's other 1152 dims are zeros,
# so the projection carries its embedding and LM head over exactly), where a head's default
# is its target's width (3x the compute per step here; BENCHMARKS.md has both measured). Its
# 8192-id vocabulary holds the ids the data uses most. The rates are the rounded ones
# measured here (the target's labelling pass with its features; a 576-wide step).
CPU_EAGLE3 = DistillConfig(
    head="eagle3", layers=1, width=576, draft_vocab=8192, depth=3, steps=360, batch=4,
    seq_len=256, data_tokens=16384, heldout_tokens=1024, lr=5e-4, warmup=10, eval_every=60,
    save_every=60,
)  # fmt: skip
CPU_EAGLE3_RATES = {"teacher_tokens_per_s": 50.0, "student_tokens_per_s": 450.0}


def cost_seconds(config: DistillConfig, rates: dict[str, float]) -> float:
    """A run's time from its sizes and measured rates: labelled tokens / teacher rate +
    steps x batch x seq_len / student-step rate (evaluations not counted)."""
    teacher = config.data_tokens / rates["teacher_tokens_per_s"]
    return teacher + config.steps * config.batch * config.seq_len / rates["student_tokens_per_s"]


def distilled_dir() -> Path:
    """Where `specmlx models build cpu-distilled` puts its draft."""
    return specmlx_home() / "cpu-distilled" / "draft"


def eagle3_dir() -> Path:
    """Where `specmlx models build cpu-eagle3` puts its head."""
    return specmlx_home() / "cpu-eagle3" / "head"
