"""rich rendering for the CLI: the live line, the summary, model tables. What a command was
asked for (a listing, a table, a result) goes to stdout (out_console), progress, warnings and
errors to stderr (err_console), so `specmlx models list | grep distill` finds its rows."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..core.stats import Stats
from ..models.footprint import model_size
from ..models.inspection import is_cached


def err_console() -> Console:
    """stderr console; rich drops colour codes by itself when stderr is not a terminal,
    where tables also get a fixed width instead of 80 columns."""
    console = Console(stderr=True, highlight=False)
    if not console.is_terminal:
        console.width = 160
    return console


# stdout's width where it is not a terminal: no row of a table is cut or wrapped (grep, cut
# and sort see each row as one whole line); tables and lines take only the width they need
PIPE_WIDTH = 10_000


def out_console() -> Console:
    """stdout console, for what a command was asked for; rich drops colour codes by itself
    when stdout is not a terminal, where nothing is wrapped either (PIPE_WIDTH). For tables
    and lines: a rule or a panel would fill that width."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = PIPE_WIDTH
    return console


def gb(n: int | float) -> str:
    return f"{n / 1e9:.2f} GB"


def live_line(stats: Stats, k_label: str) -> Text:
    """The line shown while generating: tok/s, acceptance, k, tokens."""
    line = Text()
    line.append(f"{stats.generated} tok", style="bold")
    line.append(f"  {stats.decode_tps:.1f} tok/s")
    if stats.drafted:
        line.append(f"  accept {stats.acceptance_rate:.0%}", style="green")
        k = stats.last.k if stats.last else 0
        line.append(f"  {stats.tokens_per_pass:.2f} tok/pass  k={k} ({k_label})")
    return line


def summary(
    stats: Stats,
    *,
    target: str,
    draft: str,
    load_s: float | None = None,
    server: str = "",
    ranks: str = "",
) -> Table:
    """The final statistics, one row each, explained in the README."""
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="dim")
    t.add_column()
    t.add_row("models", f"{target}  ←  draft: {draft}")
    cached = f" ({stats.cached_tokens} from the prompt cache)" if stats.cached_tokens else ""
    t.add_row("prompt", f"{stats.prompt_tokens} tok{cached}, {stats.prompt_tps:.1f} tok/s")
    t.add_row(
        "decode", f"{stats.generated} tok in {stats.decode_s:.2f} s, {stats.decode_tps:.2f} tok/s"
    )
    if stats.rounds:
        t.add_row(
            "speculation",
            f"{stats.accepted}/{stats.drafted} drafts accepted ({stats.acceptance_rate:.0%}), "
            f"{stats.tokens_per_pass:.2f} tok per target pass, {stats.rounds} passes",
        )
        if stats.drafted:
            hist = " ".join(f"{n}:{c}" for n, c in enumerate(stats.accept_hist) if c)
            t.add_row("accepted/pass", hist)
            depth = " ".join(f"{a:.0%}" for a in stats.accept_by_depth[:8])
            t.add_row("by depth", f"{depth} (draft d accepted when those before it were)")
            if stats.tree_off:
                t.add_row("trees", f"off: {stats.tree_off}")
            elif stats.tree_rounds:
                by_rank = " ".join(f"{a:.0%}" for a in stats.accept_by_rank)
                t.add_row(
                    "trees",
                    f"{stats.tree_rounds} of {stats.rounds} passes, "
                    f"{stats.verified_per_pass:.1f} drafts verified a pass; side leaves kept "
                    f"by rank {by_rank or '-'} (where the chain was rejected)",
                )
            t.add_row(
                "time split",
                f"draft {stats.draft_s:.2f} s, target {stats.target_s:.2f} s "
                f"(draft timed on {stats.timed_rounds} of {stats.rounds} rounds)",
            )
    load = f", load {load_s:.1f} s" if load_s is not None else ""
    t.add_row(
        "memory", f"peak {gb(stats.peak_memory)}{load}" + (" (on the server)" if server else "")
    )
    if ranks:
        t.add_row("ranks", ranks)
    if stats.finish_reason:
        t.add_row("finish", stats.finish_reason)
    return t


# greedy rows against target-only: only "diverged" is a failure (bench.py says why)
SAME_SHOWN = {
    "identical": "[green]identical[/green]",
    "near-tie": "[yellow]near-tie[/yellow]",
    "diverged": "[red]DIVERGED[/red]",
}


def bench_table(result: dict) -> Table:
    """The benchmark rows: speed, speedup, acceptance, theory and whether greedy output was
    the target's ("identical", a "near-tie" rounding can flip, or "diverged")."""
    t = Table(title="specmlx bench (decode tok/s, medians over repeats)", title_justify="default")
    for col in (
        "system",
        "drafter",
        "k",
        "verify",
        "tree",
        "T",
        "tok/s",
        "speedup",
        "accept",
        "tok/pass",
        "theory",
        "eff.",
        "same",
    ):
        t.add_column(col, justify="right" if col not in ("system", "drafter") else "left")
    for r in result["rows"]:
        same = SAME_SHOWN.get(r.get("same_as_target"), "-")
        eff = f"{r['efficiency']:.0%}" if r["efficiency"] else "-"
        t.add_row(
            r["system"],
            r["drafter"],
            str(r["k"]),
            r.get("verify") or "-",
            str(r.get("tree") or "-"),
            f"{r['temperature']:g}",
            f"{r['tokens_per_sec']:.2f}",
            f"{r['speedup']:.2f}x",
            f"{r['acceptance_rate']:.0%}",
            f"{r['tokens_per_pass']:.2f}",
            "-" if r["theoretical_speedup"] is None else f"{r['theoretical_speedup']:.2f}x",
            eff,
            same,
        )
    curve = "  ".join(f"{n}:{v:.2f}" for n, v in result["pass_curve"].items())
    cost = result.get("draft_cost")
    t.caption = f"pass cost t(n)/t(1): {curve}" + (f"   c = {cost:.3f}" if cost else "")
    for note in result.get("notes", []):
        t.caption += f"\n{note}"
    for r in result["rows"]:
        if "tree_passes" in r:  # (a row asked for trees: how many it verified)
            ranks = " ".join(f"{a:.0%}" for a in r["accept_by_rank"]) or "-"
            t.caption += (
                f"\ntrees, {r['drafter']} k={r['k']} tree={r.get('tree') or '-'} "
                f"T={r['temperature']:g}: {r['tree_passes']} of {r['passes']} passes, "
                f"{r['verified_per_pass']:.1f} drafts verified a pass, side leaves kept by "
                f"rank {ranks}"
            )
    return t


def overhead_table(rows: list) -> Table:
    """`specmlx bench --overhead`: seconds per token of both tools, their paired ratio and the
    ratio of their best repeats."""
    table = Table(title="host overhead per token (tiny random Llama, V = 32000, greedy)")
    cols = (
        "k",
        "specmlx ms/tok",
        "mlx-lm ms/tok",
        "specmlx / mlx-lm",
        "best / best",
        "same tokens",
    )
    for col in cols:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.k),
            f"{r.specmlx_s * 1000:.2f}",
            f"{r.mlx_lm_s * 1000:.2f}",
            f"{r.ratio:.2f}x",
            f"{r.best_ratio:.2f}x",
            "yes" if r.identical else "NO",
        )
    return table


def print_warning(message: str) -> None:
    """One yellow line on stderr, inner newlines folded."""
    line = " ".join(message.split())
    err_console().print(Text.assemble(("warning: ", "yellow"), line), soft_wrap=True)


def print_error(message: str) -> None:
    """One red line on stderr: no wrapping, no markup parsing, inner newlines folded."""
    line = " ".join(message.split())
    err_console().print(Text.assemble(("error: ", "bold red"), line), soft_wrap=True)


# `models list`: at this width or more (and in a pipe) each fact has its own column; a
# narrower terminal gets three, so that each alias still shows whole on its own line
WIDE_LIST = 140


def models_table(registry, width: int = PIPE_WIDTH) -> Table:
    """Aliases with their source, dtype/quantization, size when local ("?" when it cannot be
    told) and a label, then the pairs, a pair a line.

    registry: the merged models.toml files; width: the columns to fit, the console's (a
    terminal's, $COLUMNS, or PIPE_WIDTH in a pipe). From WIDE_LIST columns up each fact has
    its column. Narrower there are three: the alias with its dtype and quantization under
    it, the source with its label under it, and the size (or "no") saying whether the files
    are here. Aliases are never cut or wrapped; sources and labels fold."""
    wide = width >= WIDE_LIST
    # "default": left, and not padded out to the table's width (no trailing blanks in a pipe);
    # in a terminal the table takes its width, which the pairs below are broken to fit
    t = Table(title="models (models.toml)", title_justify="default", caption_justify="default",
              expand=width < PIPE_WIDTH)  # fmt: skip
    t.add_column("alias", no_wrap=True)
    t.add_column("source", overflow="fold")
    if wide:
        for col in ("dtype", "quant", "local", "size"):
            t.add_column(col)
        t.add_column("note", overflow="fold")
    else:
        t.add_column("local", no_wrap=True)
    present, total = 0, 0
    for alias, spec in sorted(registry.models.items()):
        quant = f"{spec.quantize.bits}-bit g{spec.quantize.group_size}" if spec.quantize else ""
        quant = quant or ("as in file" if spec.keep_quantized else "")
        local = is_cached(spec)
        size = ""
        if local:  # sizing a remote model would mean a download: only local ones
            nbytes = model_size(spec)
            size = "?" if nbytes is None else gb(nbytes)
            present, total = present + 1, total + (nbytes or 0)
        if wide:
            t.add_row(alias, spec.source, spec.dtype, quant, "yes" if local else "no", size,
                      spec.label)  # fmt: skip
            continue
        name = Text(alias)
        name.append("\n" + ", ".join(filter(None, (spec.dtype, quant))), style="dim")
        source = Text(spec.source)
        if spec.label:
            source.append("\n" + spec.label, style="dim")
        t.add_row(name, source, ("yes" if size == "?" else size) if local else "no")
    here = (
        f"present: {present} model{'s' * (present != 1)}, {gb(total)} (`models rm ALIAS` frees one)"
    )
    t.caption = here + "\npairs:" + "".join(_pair_lines(registry.pairs.values(), width))
    return t


def _pair_lines(pairs, width: int) -> list[str]:
    """A pair a line, so grep finds a pair whole as it finds a model's row; a line longer
    than ``width`` is broken before its draft rather than wherever rich would wrap it."""
    lines = []
    for p in pairs:
        line = f"\n  {p.name} = {p.target} + {p.draft} (k {p.k})"
        if len(line) > width + 1:
            line = f"\n  {p.name} = {p.target}\n      + {p.draft} (k {p.k})"
        lines.append(line)
    return lines
