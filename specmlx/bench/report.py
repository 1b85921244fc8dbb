"""The benchmark's verdicts and report: greedy rows checked against target-only (identical,
near-tie or diverged), the statistics of each row, the environment facts, Markdown and a plot."""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import subprocess
from pathlib import Path

import mlx.core as mx

from ..core.caches import make_caches
from ..errors import BadInput
from ..machine import blas_in_use, version
from .data import BenchSettings, Run, System, runs_at

# two logits this close (relative to the top one) count as tied: fp16 rounds at 2^-11 of a
# value, so this is about two of its units in the last place. Coarser dtypes get 2 eps of
# their own (bfloat16: 2^-7 relative each), since their rounding alone can flip such a pair.
NEAR_TIE_REL = 1e-3


def theoretical_speedup(a: float, k: int, draft_cost: float) -> float:
    """Leviathan et al.'s expected speedup when verifying k tokens costs one target step:
    (1 - a^(k+1)) / ((1 - a)(k c + 1)), with a the acceptance rate and c = draft_cost, the
    time of a draft step over a target step."""
    tokens = float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return tokens / (k * draft_cost + 1.0)


def spread(values: list[float]) -> dict:
    """median, min and max of a list of measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length when one
    is a prefix of the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tie_tolerance(top: float, dtype: mx.Dtype) -> float:
    """How far below the top logit ``top`` a logit may be and still count as tied with it:
    NEAR_TIE_REL of its magnitude, or 2 eps of ``dtype`` (the logits' own) where coarser."""
    return max(NEAR_TIE_REL, 2 * mx.finfo(dtype).eps) * max(abs(top), 1.0)


def classify_difference(logits: mx.array, ref_token: int, token: int) -> str:
    """Where a greedy run first differs from target-only (which chose ``ref_token``, the run
    ``token``), given the target's logits (V,) at that position: "near-tie" when both tokens
    score within tie_tolerance of the best logit (so their gap, a top-2 gap, is below it:
    a kernel's rounding can flip it), else "diverged"."""
    top = float(logits.max().item())
    low = min(float(logits[ref_token].item()), float(logits[token].item()))
    return "near-tie" if top - low <= tie_tolerance(top, logits.dtype) else "diverged"


def target_logits_after(target, context: list[int], step: int = 512) -> mx.array:
    """The target's logits (V,) for the token after ``context``: a fresh cache prefilled in
    chunks, then one single-token pass, the shape target-only decoding used."""
    cache = make_caches(target)
    head = context[:-1]
    for i in range(0, len(head), step):
        target(mx.array(head[i : i + step], dtype=mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return target(mx.array(context[-1:], dtype=mx.uint32)[None], cache=cache)[0, -1]


def greedy_verdict(target, prompt: list[int], ref: list[int], tokens: list[int]) -> str:
    """ "identical", "near-tie" or "diverged": a greedy run's ``tokens`` against target-only's
    ``ref`` for the same ``prompt``; the target is run (once) only when they differ. A run that
    ends early or runs on past the reference cannot be judged by a tie: "diverged"."""
    at = first_difference(ref, tokens)
    if at is None:
        return "identical"
    if at >= min(len(ref), len(tokens)):
        return "diverged"
    logits = target_logits_after(target, prompt + ref[:at])
    return classify_difference(logits, ref[at], tokens[at])


def judge_greedy_runs(runs: list[Run], prompts: dict[str, list[int]], target, base: str) -> None:
    """Set ``same`` on every greedy run: compared with the target-only run (label ``base``)
    of the same prompt and repeat. Sampled runs are left None."""
    ref = {(r.prompt, r.repeat): r.tokens for r in runs if r.label == base and r.temperature == 0}
    for r in runs:
        if r.temperature == 0 and (r.prompt, r.repeat) in ref:
            r.same = greedy_verdict(target, prompts[r.prompt], ref[(r.prompt, r.repeat)], r.tokens)


SAME_ORDER = ("identical", "near-tie", "diverged")


def worst_same(runs: list[Run], ref: dict) -> str:
    """The worst verdict over a row's greedy runs; a run never checked counts as identical
    only when its tokens are."""
    verdicts = [
        r.same or ("identical" if r.tokens == ref[(r.prompt, r.repeat)] else "diverged")
        for r in runs
    ]
    return max(verdicts, key=SAME_ORDER.index, default="identical")


def summarize(
    runs: list[Run],
    todo: list[System],
    s: BenchSettings,
    draft_cost: float | None,
    head: tuple[str, float] | None = None,
) -> list[dict]:
    """One row per (system, temperature): medians over repeats of whole-prompt-set tok/s.
    draft_cost: the draft model's step cost c (against a target step); head: (name, c) of
    an MTP head benched beside it, whose rows use its own c."""
    rows = []
    for temp in s.temps:
        base_label = todo[0].label  # target-only comes first
        base = _per_repeat(runs, base_label, temp, s.repeats)
        ref = {
            (r.prompt, r.repeat): r.tokens
            for r in runs
            if r.label == base_label and r.temperature == temp
        }
        for system in (sy for sy in todo if runs_at(sy, temp, s)):
            tps = _per_repeat(runs, system.label, temp, s.repeats)
            mine = [r for r in runs if r.label == system.label and r.temperature == temp]
            same = worst_same(mine, ref) if temp == 0 else None
            drafted = sum(r.drafted for r in mine)
            a = sum(r.accepted for r in mine) / drafted if drafted else 0.0
            k_mean = drafted / max(1, sum(_rounds(r) for r in mine)) if drafted else 0.0
            k_theory = k_mean if system.k.auto else system.k.fixed
            cost = 0.0 if system.drafter.startswith("look") else (draft_cost or 0.0)  # (lookahead)
            if head is not None and system.drafter.split(" + ")[0] == head[0]:
                cost = head[1]
            theory = theoretical_speedup(a, k_theory, cost) if system.k.fixed != 0 else 1.0
            trees = not system.tree.off or system.drafter.startswith("lookahead")
            if trees:  # (a chain's formula: a tree's nodes are not a chain's k)
                theory = None
            speedups = [x / b for x, b in zip(tps, base, strict=True)]
            speed = statistics.median(speedups)
            rows.append(
                {
                    "system": system.system,
                    "drafter": system.drafter,
                    "k": system.k.value,
                    "verify": system.verify if system.system == "specmlx" else None,
                    "tree": system.tree.value if system.system == "specmlx" else None,
                    "temperature": temp,
                    **_named("tokens_per_sec", tps),
                    **_named("speedup", speedups),
                    "acceptance_rate": a,
                    "tokens_per_pass": sum(len(r.tokens) for r in mine)
                    / max(1, sum(_rounds(r) for r in mine)),
                    "draft_cost": cost,
                    "theoretical_speedup": theory,
                    "efficiency": speed / theory if theory else None,
                    "same_as_target": same,
                    "identical_to_target": None if same is None else same == "identical",
                    "decoded_tokens": sum(r.decoded for r in mine),
                    "accept_by_depth": _by_depth(mine),
                    **(_tree_stats(mine) if trees else {}),
                }
            )
    return rows


def _tree_stats(runs: list[Run]) -> dict:
    """A tree row's statistics, pooled over its runs: the passes that verified a tree and
    all passes, drafted tokens a pass verified (a tree's nodes count), and P(side leaf of
    rank s kept | the chain rejected at its depth), s = 0, 1, ..."""
    passes = sum(_rounds(r) for r in runs)
    tried = [sum(t) for t in itertools.zip_longest(*(r.rank_tried for r in runs), fillvalue=0)]
    kept = [sum(k) for k in itertools.zip_longest(*(r.rank_kept for r in runs), fillvalue=0)]
    return {
        "tree_passes": sum(r.tree_rounds for r in runs),
        "passes": passes,
        "verified_per_pass": sum(r.drafted for r in runs) / max(1, passes),
        "accept_by_rank": [k / t for k, t in zip(kept, tried, strict=True) if t],
    }


def _by_depth(runs: list[Run]) -> list[float]:
    """P(draft d accepted | drafts before it accepted), d = 1, 2, ..., pooled over runs."""
    tried: list[int] = []
    kept: list[int] = []
    for r in runs:
        for d, (t, a) in enumerate(zip(r.depth_tried, r.depth_accepted, strict=True)):
            if d == len(tried):
                tried.append(0)
                kept.append(0)
            tried[d] += t
            kept[d] += a
    return [a / t for a, t in zip(kept, tried, strict=True) if t]


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


def git_revision() -> str | None:
    """The revision of the specmlx source that is running (None outside a git checkout),
    with "+dirty" when its tracked files differ from it. Read when a run starts: the tree
    may move on while a long benchmark runs, the imported code does not."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=5)

    try:
        rev = git("rev-parse", "--short", "HEAD").stdout.strip()
        dirty = rev and git("diff", "--quiet", "HEAD", "--", ".").returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def environment(models: dict, rev: str | None = None) -> dict:
    """Versions, backend, BLAS, OS and chip, models, git revision (``rev``, from
    git_revision when the run started): what a figure depends on."""
    from .. import __version__

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
        "git": rev,
    }


def to_markdown(result: dict) -> str:
    """The rows as a Markdown table, plus the pass-cost curve and environment."""
    head = "| system | drafter | k | verify | tree | temp | tok/s (min-max) | speedup | accept | tok/pass | theory | eff. | same as target |"
    lines = [head, "|" + "---|" * 13]
    shown = {"identical": "identical", "near-tie": "near-tie", "diverged": "**diverged**"}
    for r in result["rows"]:
        same = shown.get(r.get("same_as_target"), "n/a")
        eff = f"{r['efficiency']:.0%}" if r["efficiency"] else "-"
        lines.append(
            f"| {r['system']} | {r['drafter']} | {r['k']} | {r.get('verify') or '-'} | "
            f"{r.get('tree') or '-'} | {r['temperature']} | "
            f"{r['tokens_per_sec']:.2f} ({r['tokens_per_sec_min']:.2f}-{r['tokens_per_sec_max']:.2f}) | "
            f"{r['speedup']:.2f}x | {r['acceptance_rate']:.0%} | {r['tokens_per_pass']:.2f} | "
            f"{_times(r['theoretical_speedup'])} | {eff} | {same} |"
        )
    depths = [
        f"{r['system']} {r['drafter']} k={r['k']} T={r['temperature']}: "
        + " ".join(f"{a:.0%}" for a in r["accept_by_depth"][:8])
        for r in result["rows"]
        if r.get("accept_by_depth")
    ]
    if depths:
        lines += ["", "Acceptance by depth (draft d accepted when those before it were, d = 1..8):"]
        lines += [f"- {line}" for line in depths]
    curve = ", ".join(f"{n}: {v:.2f}" for n, v in result["pass_curve"].items())
    lines += ["", f"Pass cost (target pass over n tokens / 1 token): {curve}"]
    if result.get("draft_cost") is not None:
        lines.append(f"Draft/target step cost c = {result['draft_cost']:.3f}")
    if result.get("head_cost") is not None:
        lines.append(
            f"Head/target step cost c = {result['head_cost']:.3f} (one step of a chained head; "
            "a block drafter's block divided by its drafts)"
        )
    lines.append(
        "Same as target (greedy rows): near-tie = the first difference is where the target's "
        f"two candidates score within {NEAR_TIE_REL:g} of the top logit (2 eps of the logits' "
        "dtype where coarser), which rounding can flip; only diverged is a failure"
    )
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
            key = (r["system"], r["drafter"], r.get("tree"), r["temperature"])
            groups.setdefault(key, []).append(r)
    for (system, drafter, tree, temp), rs in groups.items():
        ks = [r["k"] for r in rs]
        name = f"{system} {drafter}" + (f" tree={tree}" if tree not in (None, "off") else "")
        name += f" T={temp}"
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


def _times(x: float | None) -> str:
    """A ratio as the tables show it ("1.23x"), "-" where there is none."""
    return "-" if x is None else f"{x:.2f}x"
