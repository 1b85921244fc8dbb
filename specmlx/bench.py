"""The side-by-side benchmark: target-only, specmlx at each k, mlx-lm's own speculative loop.

Every system runs in one process on the same loaded models, prompts, sampler settings and
seeds, interleaved within each repeat so that a noisy machine's drift hits all of them alike.
Decode speed counts the tokens after a system's first target pass (prefill and the first
round excluded, the same rule for every system) over the wall time they took. Adaptive k
keeps its estimates from one generation to the next, as `specmlx run` does on disk, and its
warm-up feeds them: the rows measure auto once it has seen the pair, not its first rounds ever.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import mlx.core as mx

from .adaptive import AdaptiveK, pass_times
from .choosers import ChooserStore
from .distributed import Lockstep, SharedK, World
from .engine import generate_tokens
from .errors import BadInput
from .machine import blas_in_use, version
from .sampling import SamplingParams
from .stats import Stats


def theoretical_speedup(a: float, k: int, draft_cost: float) -> float:
    """Leviathan et al.'s expected speedup when verifying k tokens costs one target step:
    (1 - a^(k+1)) / ((1 - a)(k c + 1)), with a the acceptance rate and c = draft_cost, the
    time of a draft step over a target step."""
    tokens = float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return tokens / (k * draft_cost + 1.0)


def spread(values: list[float]) -> dict:
    """median, min and max of a list of measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@dataclass(frozen=True)
class System:
    """One configuration under test."""

    system: str  # "target-only", "specmlx", "mlx-lm"
    drafter: str  # "none", the draft alias, "lookup", "<draft> + lookup"
    k: int | str

    @property
    def label(self) -> str:
        return f"{self.system} {self.drafter} k={self.k}"


@dataclass
class Run:
    """One generation: what came out and how long the decode part took."""

    label: str
    prompt: str
    temperature: float
    repeat: int
    tokens: list[int]
    decoded: int  # tokens after the first target pass
    decode_s: float
    drafted: int
    accepted: int


@dataclass
class BenchSettings:
    ks: list[int | str] = field(default_factory=lambda: [1, 2, 4, 8, "auto"])
    temps: list[float] = field(default_factory=lambda: [0.0, 0.8])
    top_p: float = 0.95
    max_tokens: int = 128
    repeats: int = 3
    compare_mlx_lm: bool = True
    lookup: bool = False  # add lookup and hybrid rows
    seed: int = 0


def load_prompts(path: str | None, kind: str = "all") -> list[dict]:
    """The packaged code prompts, or any JSONL of {"prompt": ...}; ``kind`` filters by "kind".
    A row with "chat": true is an instruction, sent through the tokenizer's chat template."""
    try:
        text = (
            Path(path).read_text(encoding="utf-8")
            if path
            else resources.files("specmlx")
            .joinpath("data/prompts.jsonl")
            .read_text(encoding="utf-8")
        )
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(
            f"cannot read prompts {path}: {e.strerror if isinstance(e, OSError) else e}"
        ) from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}:{i}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise BadInput(f'{path}:{i}: expected an object with a non-empty "prompt" string')
        row.setdefault("id", f"p{i}")
        if kind == "all" or row.get("kind", "code") == kind:
            rows.append(row)
    if not rows:
        raise BadInput(
            f"no prompts{'' if kind == 'all' else f' of kind {kind!r}'} in {path or 'the built-in set'}"
        )
    return rows


def _timed(events: Iterable[tuple[int, bool]]) -> tuple[list[int], int, float]:
    """Consume (token, from_draft) pairs; decode timing starts at the first target token.
    A generation with none (an immediate EOS, or a short budget filled by accepted drafts
    alone) has nothing to time: (tokens, 0, 0.0)."""
    tokens, mark, at = [], None, 0
    for tok, from_draft in events:
        tokens.append(tok)
        if mark is None and not from_draft:
            mark, at = time.perf_counter(), len(tokens)
    if mark is None:
        return tokens, 0, 0.0
    end = time.perf_counter()
    return tokens, len(tokens) - at, end - mark


def _mlx_lm_events(
    target, draft, ids, k, temp, top_p, max_tokens, seed
) -> Iterator[tuple[int, bool]]:
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    sampler = make_sampler(temp, top_p=top_p if top_p < 1 else 0.0)
    prompt = mx.array(ids, dtype=mx.uint32)
    if draft is None:
        for tok, _ in generate_step(prompt, target, max_tokens=max_tokens, sampler=sampler):
            yield int(tok), False
        return
    for tok, _, from_draft in speculative_generate_step(
        prompt, target, draft, num_draft_tokens=k, max_tokens=max_tokens, sampler=sampler
    ):
        yield int(tok), bool(from_draft)


def run_one(
    system: System,
    target,
    draft,
    ids,
    temp,
    s: BenchSettings,
    seed: int,
    shared: int | None,
    chooser: AdaptiveK | None = None,
    world: World | None = None,
):
    """Generate once with one system; returns (tokens, decoded, decode_s, drafted, accepted).
    ``chooser`` is the system's adaptive-k state when k is "auto" (a fresh one if None);
    ``world``: the ranks the target is split over (k decided on rank 0, tokens compared)."""
    top_p = s.top_p if temp > 0 else 1.0
    if system.system == "mlx-lm":
        flags: list[bool] = []

        def events():
            d = draft if system.drafter != "none" else None
            for tok, fd in _mlx_lm_events(
                target, d, ids, system.k, temp, top_p, s.max_tokens, seed
            ):
                flags.append(fd)
                yield tok, fd

        tokens, decoded, secs = _timed(events())
        accepted = sum(flags)
        rounds = len(flags) - accepted  # every mlx-lm round ends with one target token
        return tokens, decoded, secs, rounds * int(system.k), accepted
    stats = Stats()
    use_draft = draft if system.drafter not in ("none", "lookup") else None
    k = (chooser or "auto") if system.k == "auto" else system.k
    lockstep = None
    if world is not None and world.distributed:
        lockstep = Lockstep(world)
        if system.k == "auto":
            k = SharedK(chooser or AdaptiveK(), world)
    gen = generate_tokens(
        target,
        use_draft,
        ids,
        sampling=SamplingParams(temp, top_p),
        num_draft=k,
        lookup="lookup" in system.drafter,
        max_tokens=s.max_tokens,
        seed=seed,
        vocab_size=shared,
        stats=stats,
        lockstep=lockstep,
    )
    tokens, decoded, secs = _timed((e.token, e.from_draft) for e in gen)
    if lockstep is not None:
        lockstep.check()
    return tokens, decoded, secs, stats.drafted, stats.accepted


def systems(draft_name: str | None, s: BenchSettings) -> list[System]:
    out = [System("target-only", "none", 0)]
    if s.compare_mlx_lm:
        out.append(System("mlx-lm", "none", 0))  # mlx-lm's generate_step: our baseline's peer
    if draft_name:
        out += [System("specmlx", draft_name, k) for k in s.ks]
        if s.compare_mlx_lm:
            out += [System("mlx-lm", draft_name, k) for k in s.ks if isinstance(k, int) and k > 0]
    if s.lookup:
        out += [System("specmlx", "lookup", k) for k in s.ks]
        if draft_name:
            out += [System("specmlx", f"{draft_name} + lookup", k) for k in s.ks]
    return out


def bench(
    target,
    draft,
    prompts: list[dict],
    encode: Callable[[dict], list[int]],
    s: BenchSettings,
    *,
    draft_name: str | None = None,
    shared: int | None = None,
    on_run: Callable[[Run], None] | None = None,
    world: World | None = None,
) -> dict:
    """Run every system on every prompt and temperature, interleaved, ``s.repeats`` times.

    target, draft: the loaded models (draft None: no draft rows); prompts: rows with "id"
    and "prompt"; encode: a prompt row -> token ids; s: what to sweep; draft_name: the
    draft's alias for the rows; shared: ids the draft may propose; on_run: called after each
    generation (progress); world: the ranks the target is split over (every rank runs this
    same sequence). Returns {"rows", "runs", "verify_curve", "draft_cost"}; the CLI adds
    the environment."""
    encoded = [(p["id"], encode(p)) for p in prompts]
    todo = systems(draft_name, s)
    ctx = encoded[0][1] + encoded[0][1][: s.max_tokens // 2]
    t = pass_times(target, ctx, [*range(1, 10), 16], reps=5)
    curve = {n: t[n] / t[1] for n in t}
    cost = pass_times(draft, ctx, [1], reps=5)[1] / t[1] if draft is not None else None
    # one adaptive-k state per auto system and temperature, kept across its generations as
    # `specmlx run` keeps it on disk: what is measured is auto after its first few rounds.
    # They start from this measured curve and live in memory only.
    store = ChooserStore(persist=False, verify_ratio=[curve[k + 1] for k in range(9)])
    choosers = {
        (sy, temp): store.get(target, "bench", sy.label, _sampling(temp, s), encoded[0][1])
        for sy in todo
        if sy.k == "auto"
        for temp in s.temps
    }
    # warm-up: compile paths and fault in weights for every system once (auto: per temperature)
    warm = BenchSettings(**{**asdict(s), "max_tokens": 8})
    for system in todo:
        for temp in s.temps if system.k == "auto" else s.temps[:1]:
            chooser = choosers.get((system, temp))
            run_one(
                system, target, draft, encoded[0][1], temp, warm, s.seed, shared, chooser, world
            )
    runs: list[Run] = []
    for rep in range(s.repeats):
        for pid, ids in encoded:
            for temp in s.temps:
                seed = s.seed + rep
                for system in todo:
                    tokens, decoded, secs, drafted, accepted = run_one(
                        system,
                        target,
                        draft,
                        ids,
                        temp,
                        s,
                        seed,
                        shared,
                        choosers.get((system, temp)),
                        world,
                    )
                    run = Run(
                        system.label, pid, temp, rep, tokens, decoded, secs, drafted, accepted
                    )
                    runs.append(run)
                    if on_run:
                        on_run(run)
    return {
        "rows": summarize(runs, todo, s, cost),
        "runs": [asdict(r) for r in runs],
        "verify_curve": curve,
        "draft_cost": cost,
    }


def _sampling(temp: float, s: BenchSettings) -> SamplingParams:
    return SamplingParams(temp, s.top_p if temp > 0 else 1.0)


def summarize(
    runs: list[Run], todo: list[System], s: BenchSettings, draft_cost: float | None
) -> list[dict]:
    """One row per (system, temperature): medians over repeats of whole-prompt-set tok/s."""
    rows = []
    for temp in s.temps:
        base_label = todo[0].label  # target-only comes first
        base = _per_repeat(runs, base_label, temp, s.repeats)
        ref = {
            (r.prompt, r.repeat): r.tokens
            for r in runs
            if r.label == base_label and r.temperature == temp
        }
        for system in todo:
            tps = _per_repeat(runs, system.label, temp, s.repeats)
            mine = [r for r in runs if r.label == system.label and r.temperature == temp]
            drafted = sum(r.drafted for r in mine)
            a = sum(r.accepted for r in mine) / drafted if drafted else 0.0
            k_mean = drafted / max(1, sum(_rounds(r) for r in mine)) if drafted else 0.0
            k_theory = system.k if isinstance(system.k, int) else k_mean
            cost = 0.0 if "lookup" == system.drafter else (draft_cost or 0.0)
            theory = theoretical_speedup(a, k_theory, cost) if system.k != 0 else 1.0
            speedups = [x / b for x, b in zip(tps, base, strict=True)]
            speed = statistics.median(speedups)
            rows.append(
                {
                    "system": system.system,
                    "drafter": system.drafter,
                    "k": system.k,
                    "temperature": temp,
                    **_named("tokens_per_sec", tps),
                    **_named("speedup", speedups),
                    "acceptance_rate": a,
                    "tokens_per_pass": sum(len(r.tokens) for r in mine)
                    / max(1, sum(_rounds(r) for r in mine)),
                    "draft_cost": cost,
                    "theoretical_speedup": theory,
                    "efficiency": speed / theory if theory else None,
                    "identical_to_target": (
                        all(r.tokens == ref[(r.prompt, r.repeat)] for r in mine)
                        if temp == 0
                        else None
                    ),
                    "decoded_tokens": sum(r.decoded for r in mine),
                }
            )
    return rows


def _named(name: str, values: list[float]) -> dict:
    """{name: median, name_min: min, name_max: max}."""
    s = spread(values)
    return {name: s["median"], f"{name}_min": s["min"], f"{name}_max": s["max"]}


def _rounds(r: Run) -> int:
    """Target passes of a run: one per round, each emitting accepted drafts plus one token."""
    return max(1, len(r.tokens) - r.accepted)


def _per_repeat(runs: list[Run], label: str, temp: float, repeats: int) -> list[float]:
    """Whole-prompt-set decode tok/s for each repeat."""
    out = []
    for rep in range(repeats):
        mine = [r for r in runs if r.label == label and r.temperature == temp and r.repeat == rep]
        out.append(sum(r.decoded for r in mine) / max(1e-9, sum(r.decode_s for r in mine)))
    return out


def environment(models: dict) -> dict:
    """Versions, backend, BLAS, OS and chip, models, git revision: what a figure depends on."""
    from . import __version__

    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return {
        "specmlx": __version__,
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "device": str(mx.default_device()),
        "blas": blas_in_use(),
        "os": platform.platform(),
        "chip": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "models": models,
        "git": rev or None,
    }


def to_markdown(result: dict) -> str:
    """The rows as a Markdown table, plus the verify-cost curve and environment."""
    head = "| system | drafter | k | temp | tok/s (min-max) | speedup | accept | tok/pass | theory | eff. | same as target |"
    lines = [head, "|" + "---|" * 11]
    for r in result["rows"]:
        same = {True: "yes", False: "**NO**", None: "n/a"}[r["identical_to_target"]]
        eff = f"{r['efficiency']:.0%}" if r["efficiency"] else "-"
        lines.append(
            f"| {r['system']} | {r['drafter']} | {r['k']} | {r['temperature']} | "
            f"{r['tokens_per_sec']:.2f} ({r['tokens_per_sec_min']:.2f}-{r['tokens_per_sec_max']:.2f}) | "
            f"{r['speedup']:.2f}x | {r['acceptance_rate']:.0%} | {r['tokens_per_pass']:.2f} | "
            f"{r['theoretical_speedup']:.2f}x | {eff} | {same} |"
        )
    curve = ", ".join(f"{n}: {v:.2f}" for n, v in result["verify_curve"].items())
    lines += ["", f"Verify cost (target pass over n tokens / 1 token): {curve}"]
    if result.get("draft_cost") is not None:
        lines.append(f"Draft/target step cost c = {result['draft_cost']:.3f}")
    env = result.get("environment", {})
    for role, m in (env.get("models") or {}).items():
        if m:
            lines.append(
                f"{role}: {m['alias']} ({m['dtype']}, {m['bytes'] / 1e9:.2f} GB) {m['label']}".rstrip()
            )
    if env:
        lines += [
            "",
            "Environment: " + "; ".join(f"{k}={v}" for k, v in env.items() if k != "models"),
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """tok/s and acceptance against k per system (needs matplotlib: pip install specmlx[plot])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("--plot needs matplotlib: pip install 'specmlx[plot]'") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    groups: dict[tuple, list[dict]] = {}
    for r in result["rows"]:
        if isinstance(r["k"], int) and r["system"] != "target-only":
            groups.setdefault((r["system"], r["drafter"], r["temperature"]), []).append(r)
    for (system, drafter, temp), rs in groups.items():
        ks = [r["k"] for r in rs]
        name = f"{system} {drafter} T={temp}"
        ax1.plot(ks, [r["tokens_per_sec"] for r in rs], marker="o", label=name)
        ax2.plot(ks, [r["acceptance_rate"] for r in rs], marker="o", label=name)
    for r in result["rows"]:
        if r["system"] == "target-only":
            ax1.axhline(r["tokens_per_sec"], linestyle="--", color="gray")
    ax1.set(xlabel="k", ylabel="tok/s", title="decode speed")
    ax2.set(xlabel="k", ylabel="acceptance", title="acceptance rate")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
