"""`specmlx models list | pull | build`: the listing, and what pull and build made ("ready:"
and a built pair's facts), on stdout; the steps on the way on stderr."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from ..errors import BadInput
from .common import cli_errors
from .display import err_console, out_console
from .distill import distill_summary, show_distill


@cli_errors
def models_list() -> None:
    """Aliases, sources, sizes and whether each is present locally."""
    from ..models.registry import load_registry
    from .display import models_table

    console = out_console()
    # the terminal's width (or $COLUMNS): the table fits it; in a pipe, rows stay whole
    console.print(models_table(load_registry(), console.width))


@cli_errors
def models_pull(alias: str = typer.Argument(..., help="Alias to download or quantize.")) -> None:
    """Download a model's files into the local cache; an alias with `quantize` is then loaded
    (after the memory check) to quantize it once and cache the result."""
    from ..models.footprint import plan_memory, require_fit
    from ..models.loading import load_model
    from ..models.registry import load_registry
    from ..models.sources import fetch

    console = err_console()
    say = lambda m: console.print(m, style="dim", soft_wrap=True, markup=False)  # noqa: E731
    spec = load_registry().resolve(alias)
    if not spec.quantize:
        path = fetch(spec, progress=say)
        out_console().print(f"[green]ready:[/green] {escape(alias)} ({escape(str(path))})")
        return
    require_fit(plan_memory(spec, None, 0, progress=say), spec, None)
    loaded = load_model(spec, progress=say)
    shown = f"{escape(alias)} ({loaded.nbytes / 1e9:.2f} GB quantized)"
    out_console().print(f"[green]ready:[/green] {shown}")


@cli_errors
def models_rm(
    alias: str = typer.Argument(..., help="The alias whose files to remove."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Remove without asking."),
) -> None:
    """Remove a model's files that specmlx fetched or made: its hub or wheel download, its
    quantized copy, a stand-in it built. Files at a path of your own are never removed."""
    import shutil
    import sys

    from ..models.quantized import quantized_dir
    from ..models.registry import load_registry
    from ..models.sources import stored_files

    registry = load_registry()
    if alias not in registry.models:
        raise BadInput(f"no alias {alias!r} in models.toml: see `specmlx models list`")
    spec = registry.models[alias]
    source = stored_files(spec)
    # another alias on the same source (a 4-bit alias of a hub repo) keeps the files
    sharing = sorted(
        other for other, o in registry.models.items()
        if other != alias and source is not None and stored_files(o) == source
    )  # fmt: skip
    quantized = quantized_dir(spec)
    paths = [p for p in (quantized, None if sharing else source) if p is not None and p.exists()]
    if not paths:
        if sharing:
            why = f"its source files are {', '.join(sharing)}'s too"
        else:
            why = "none of its files are stored here"
        raise BadInput(f"{alias}: nothing to remove ({why})")
    size = sum(_bytes(p) for p in paths)
    shown = ", ".join(str(p) for p in paths)
    if not yes:
        if not sys.stdin.isatty():
            raise BadInput(f"models rm {alias} would remove {shown}: add --yes to do it unasked")
        if not typer.confirm(f"remove {shown} ({size / 1e9:.2f} GB)?", err=True):
            raise typer.Exit(1)
    for p in paths:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    kept = f"; kept the source files {', '.join(sharing)} also use" if sharing else ""
    out_console().print(
        f"removed: {escape(alias)} ({size / 1e9:.2f} GB: {escape(shown)}){escape(kept)}",
        soft_wrap=True,
    )


def _bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (links not followed: a hub snapshot's links point
    at its blobs, counted once)."""
    if path.is_file():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


@cli_errors
def models_build(
    name: str = typer.Argument(
        ..., help="What to build: cpu-demo, cpu-distilled, cpu-eagle3 (or their aliases)."
    ),
    force: bool = typer.Option(False, "--force", help="Rebuild even if it is complete."),
) -> None:
    """Build a stand-in that specmlx makes itself from SmolLM2: the CPU demo pair, the
    distilled CPU pair (the demo target and a 4-block student trained for it), or an
    EAGLE-3 head trained for the demo target."""
    from ..models.registry import BUILDS, load_registry
    from ..standins.cpu_demo import build_demo, describe

    registry = load_registry()
    spec = registry.models.get(name)
    builder = spec.build if spec is not None and spec.build else name
    if builder not in BUILDS:
        raise BadInput(f"nothing to build called {name!r}; known: {', '.join(BUILDS)}")
    console, out = err_console(), out_console()
    say = lambda m: console.print(m, style="dim", soft_wrap=True, markup=False)  # noqa: E731
    facts = build_demo(force=force and builder == "cpu-demo", progress=say)
    if not facts["built"]:
        say(f"already built: {Path(facts['target']).parent} (--force rebuilds)")
    for line in describe(facts):
        out.print(line, soft_wrap=True, markup=False)
    if builder == "cpu-distilled":
        _build_distilled(registry, force, console, out, say)
    if builder == "cpu-eagle3":
        _build_eagle3(registry, force, console, out, say)
    out.print(f"[green]ready:[/green] {builder}")


def _build_distilled(registry, force: bool, console, report, say) -> None:
    """The distilled CPU pair's draft: SmolLM2-135M (the demo target's logits) as teacher,
    CPU_DISTILLED's run on the standard library; an interrupted build resumes.

    registry: where smollm2-135m resolves; force: train again even if it is done; console:
    stderr's, for the run's progress; report: stdout's, for the finished run's facts; say:
    a progress line."""
    from ..standins.cpu_distilled import CPU_DISTILLED, CPU_RATES, cost_seconds, distilled_dir

    c = CPU_DISTILLED

    def announce(out: Path, resume: bool) -> str:
        return (
            f"distilling {out}: {c.layers} of SmolLM2-135M's 30 blocks on the standard "
            f"library's source ({c.data_tokens} tokens labelled, {c.steps} steps of {c.batch} "
            f"x {c.seq_len}); about 0.2 GB float32 on disk, about "
            f"{cost_seconds(c, CPU_RATES) / 60:.0f} min on a 2-core x86 CPU"
            + (" (resuming)" if resume else "")
        )

    # the teacher: the demo target's weights, at its precision
    _train(distilled_dir(), c, registry.resolve("smollm2-135m"), announce, force, console,
           report, say, float32=True)  # fmt: skip


def _build_eagle3(registry, force: bool, console, report, say) -> None:
    """The demo target's EAGLE-3 head: CPU_EAGLE3's run over cpu-demo-target's own features
    on the standard library; an interrupted build resumes. Arguments as _build_distilled's."""
    from ..standins.cpu_distilled import CPU_EAGLE3, CPU_EAGLE3_RATES, cost_seconds, eagle3_dir

    c = CPU_EAGLE3

    def announce(out: Path, resume: bool) -> str:
        return (
            f"training {out}: an EAGLE-3 head ({c.width} wide, a {c.draft_vocab}-id "
            f"vocabulary) over cpu-demo-target's layers on the standard library's source "
            f"({c.data_tokens} tokens labelled, {c.steps} steps of {c.batch} x {c.seq_len}, "
            f"unrolled {c.depth} deep); about 0.05 GB on disk, about "
            f"{cost_seconds(c, CPU_EAGLE3_RATES) / 60:.0f} min on a 2-core x86 CPU"
            + (" (resuming)" if resume else "")
        )

    _train(eagle3_dir(), c, registry.resolve("cpu-demo-target"), announce, force, console,
           report, say)  # fmt: skip


def _train(out: Path, config, teacher, announce, force: bool, console, report, say,
           float32: bool = False) -> None:  # fmt: skip
    """A built stand-in's distill run into ``out`` (left alone when done, unless ``force``;
    resumed when interrupted): ``announce(out, resume)`` says what it costs first; teacher:
    the ModelSpec to load (float32: cast it so); the rest as _build_distilled's."""
    import mlx.core as mx

    from ..distill.train import distill, is_done
    from ..models.loading import load_model

    if is_done(out) and not force:
        say(f"already built: {out} (--force rebuilds)")
        distill_summary(out, report)
        return
    resume = (out / "checkpoint" / "state.json").is_file() and not force
    say(announce(out, resume))
    loaded = load_model(teacher, progress=say)
    if float32:
        loaded.model.set_dtype(mx.float32)
    show_distill(distill(loaded, out, config, "stdlib", resume=resume, force=True), console)
    distill_summary(out, report)
