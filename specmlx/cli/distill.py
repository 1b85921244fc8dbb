"""`specmlx distill`, and how a distillation run is shown: its progress on stderr, the
finished run's facts and how to use the draft on stdout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import BadInput
from .common import cli_errors
from .display import err_console, out_console


def show_distill(events, console) -> dict:
    """Draw a distillation run's Events as a progress bar with its loss and latest held-out
    estimate; return the "done" Event's metrics."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("{task.description:<14}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
        console=console,
    )
    tasks: dict[str, int] = {}
    est, loss, done = "", "", {}
    with progress:
        for e in events:
            phase = "label" if e.phase == "label" else "train"
            if e.phase in ("label", "train", "eval") and phase not in tasks:
                name = "target labels" if phase == "label" else "student steps"
                tasks[phase] = progress.add_task(name, total=e.total, note="")
            if e.phase == "eval" or e.phase == "done":
                m = e.metrics
                est = f"held-out greedy {m['greedy']:.0%} alpha {m['alpha']:.0%} kl {m['kl']:.2f}"
                done = m
            if e.phase == "eval":  # a line each, so a log (or a pipe) keeps the curve
                progress.console.print(
                    f"step {e.done}/{e.total} ({e.seconds / 60:.1f} min): {est}", style="dim"
                )
            if e.phase == "train":
                loss = f"loss {e.loss:.3f}"
            if e.phase in ("label", "train", "eval"):
                note = f"{loss}  {est}" if phase == "train" else ""
                progress.update(tasks[phase], completed=e.done, note=note)
            if e.phase == "saved":
                progress.console.print(f"checkpoint at step {e.done}", style="dim")
    return done


_HEAD_NAMES = {"eagle3": "EAGLE-3 head", "dflash": "DFlash drafter", "mtp": "MTP head"}


def what_was_trained(facts: dict) -> str:
    """One line naming what a finished run trained (a student's blocks, or a head's shape)."""
    tail = (
        f"{facts['trained_params'] / 1e6:.0f}M trained, {facts['train_tokens']} tokens, "
        f"{facts['seconds'] / 60:.1f} min"
    )
    kind = facts.get("kind", "student")
    if kind == "student":
        return (
            f"student: {len(facts['picks'])} of {facts['target_layers']} blocks "
            f"(from {facts['picks']}), {facts['student_params'] / 1e6:.0f}M params, {tail}"
        )
    if kind == "eagle3":
        shape = (
            f"{facts['width']} wide, a {facts['draft_vocab']}-id vocabulary, unrolled "
            f"{facts['depth']} steps"
        )
    elif kind == "mtp":
        shape = f"{facts['family']}'s own layer, one step"
    else:
        shape = f"{facts['layers']} layers, blocks of {facts['block']}"
    return (
        f"{_HEAD_NAMES[kind]}: reads target layers {facts['reads']}, {shape}, "
        f"{facts['head_params'] / 1e6:.0f}M params, {tail}"
    )


def distill_summary(out: Path, console: Console) -> None:
    """Print a finished run's facts from ``out``/distill.json: what was trained, the
    held-out agreement, alpha and KL before and after (by depth for a head), the throughput.

    out: the run's directory; console: where to print (stdout's: the facts are what the
    command was run for)."""
    from ..distill.forwards import depth_line

    facts = json.loads((out / "distill.json").read_text())
    first, last = facts["evals"][0], facts["evals"][-1]
    console.print(what_was_trained(facts), soft_wrap=True, markup=False)
    console.print(
        f"held-out: greedy agreement {first['greedy']:.1%} -> {last['greedy']:.1%}, "
        f"alpha (T = 1) {first['alpha']:.1%} -> {last['alpha']:.1%}, "
        f"KL {first['kl']:.3f} -> {last['kl']:.3f}",
        soft_wrap=True,
        markup=False,
    )
    by_depth = depth_line(last)
    if len(by_depth) > 1:
        shown = ", ".join(f"{g:.0%}" for g in by_depth)
        console.print(f"held-out greedy agreement by depth: {shown}", soft_wrap=True, markup=False)
    rates = [
        f"{name} {facts[key]:.0f} tok/s"
        for name, key in (
            ("teacher", "teacher_tokens_per_s"),
            ("student step", "student_tokens_per_s"),
        )
        if key in facts
    ]
    if rates:
        console.print("throughput: " + ", ".join(rates), soft_wrap=True, markup=False)


@cli_errors
def distill(
    target: str = typer.Option(..., "--target", "-t", help="Target (teacher) alias or path."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the student model."),
    layers: int | None = typer.Option(
        None, "--layers", help="The student's blocks (4), or a DFlash drafter's layers (1)."
    ),
    head: str | None = typer.Option(
        None, "--head", help="Train a head over the target's hidden states: eagle3, dflash or mtp."
    ),
    depth: int = typer.Option(3, "--depth", help="EAGLE-3: training-time-test steps."),
    draft_vocab: int = typer.Option(
        0, "--draft-vocab", help="EAGLE-3: its vocabulary (0: 32000 or the target's)."
    ),
    width: int = typer.Option(0, "--width", help="EAGLE-3: its hidden size (0: the target's)."),
    block: int = typer.Option(16, "--block", help="DFlash: the block size it drafts."),
    init: str = typer.Option("spaced", "--init", help="spaced | first | random blocks."),
    loss: str = typer.Option("kl", "--loss", help="kl (forward KL) or tvd."),
    data: str = typer.Option("stdlib", "--data", help="'stdlib', a text file or a directory."),
    data_from: str = typer.Option(
        "files", "--data-from", help="files, or target: the target's own samples at T = 1."
    ),
    top_k: int = typer.Option(32, "--top-k", help="Target log-probs kept per position."),
    data_tokens: int = typer.Option(65536, "--data-tokens", help="Training tokens labelled."),
    heldout_tokens: int = typer.Option(1024, "--heldout-tokens", help="Held-out tokens."),
    steps: int = typer.Option(200, "--steps", help="Training steps."),
    batch: int = typer.Option(4, "--batch", help="Sequences per step."),
    seq_len: int = typer.Option(256, "--seq-len", help="Tokens per sequence."),
    lr: float = typer.Option(3e-4, "--lr", help="Peak learning rate (AdamW, cosine)."),
    warmup: int = typer.Option(20, "--warmup", help="Warm-up steps."),
    seed: int = typer.Option(0, "--seed", help="Data order, split and init."),
    eval_every: int = typer.Option(50, "--eval-every", help="Steps between estimates."),
    save_every: int = typer.Option(50, "--save-every", help="Steps between checkpoints."),
    name: str | None = typer.Option(None, "--name", help="Alias (default: the out dir's name)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out."),
    force: bool = typer.Option(False, "--force", help="Start over in a non-empty --out."),
) -> None:
    """Train a draft for a target by distillation (DistillSpec): its embeddings and head,
    L of its blocks, trained on its own next-token distributions; or, with --head, an
    EAGLE-3 head, a DFlash drafter or an MTP head over its hidden states. Writes an MLX
    model dir (a head in its published layout; for MTP, the target with its head) and a
    models.toml that pairs it with the target."""
    from ..distill.student import DistillConfig, data_files
    from ..distill.train import distill as run_distill
    from ..distill.train import is_done, registry_entry
    from ..models.loading import load_model
    from ..models.registry import load_registry
    from ..paths import atomic_write

    config = DistillConfig(
        layers=layers if layers is not None else (1 if head else 4), head=head or "",
        depth=depth, draft_vocab=draft_vocab, width=width, block=block, init=init, loss=loss, data_from=data_from, top_k=top_k,
        data_tokens=data_tokens, heldout_tokens=heldout_tokens, steps=steps, batch=batch,
        seq_len=seq_len, lr=lr, warmup=warmup, seed=seed, eval_every=eval_every,
        save_every=save_every,
    )  # fmt: skip
    config.check(10**9)  # every value but the depth, before anything loads
    out = out.expanduser().resolve()
    alias = name or out.name
    if not re.fullmatch(r"[\w.-]+", alias):
        raise BadInput(f"--name {alias!r}: use letters, digits, '.', '_' and '-'")
    data_files(data)  # a missing path says so before a model loads
    registry = load_registry()
    spec = registry.resolve(target)
    known = target in registry.models  # else the toml names the target by its source
    tname, source = (target, None) if known else (spec.alias, f"{spec.kind}:{spec.ref}")
    if alias == tname:
        raise BadInput(f"the draft needs a name other than its target's ({tname}): --name")
    console = err_console()
    say = lambda m: console.print(m, style="dim", soft_wrap=True, markup=False)  # noqa: E731
    loaded = load_model(spec, progress=say)
    try:
        show_distill(run_distill(loaded, out, config, data, resume=resume, force=force), console)
    except KeyboardInterrupt:
        if (out / "checkpoint").is_dir():
            say(f"stopped; the last checkpoint is in {out}: --resume continues from it")
        raise
    assert is_done(out)
    what = f"a {config.head} head" if config.head else f"{config.layers} blocks"
    label = f"distilled from {spec.alias}: {what}, {config.steps} steps"
    entry = registry_entry(alias, out, tname, source, label, config.head)
    atomic_write(out / "models.toml", entry)
    report = out_console()
    distill_summary(out, report)
    report.print(f"[green]ready:[/green] {escape(str(out))}", soft_wrap=True)
    draft = f"{config.head}:{alias}" if config.head else alias
    if config.head == "mtp":  # the directory is the target with its head
        tname, draft = alias, "mtp"
    report.print(
        f"  SPECMLX_MODELS={out / 'models.toml'} specmlx run --target {tname} --draft {draft} "
        "'def fib(n):'",
        soft_wrap=True,
        markup=False,
    )
