"""`specmlx bench`: the side-by-side benchmark, or the host-overhead measurement. The result
tables on stdout; loading, the progress bar and the timing status on stderr."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer

from ..core.acceptance import DEFAULT_VERIFY
from ..distributed.launch import rank_prefix
from ..drafting.choosing.choosers import K
from ..drafting.choosing.tree_size import TreeSize
from ..drafting.lookup.lookahead import LookaheadSize
from ..errors import BadInput
from ..models.registry import MTP
from .common import (
    DraftOpt,
    HostfileOpt,
    HostsOpt,
    TargetOpt,
    cli_errors,
    rank_timeout,
    resolve_models,
)
from .display import err_console, out_console, print_error
from .ranks import check_split, launch_command


def _split(text: str, convert, name: str) -> list:
    try:
        values = [convert(v.strip()) for v in text.split(",") if v.strip()]
    except (ValueError, BadInput) as e:
        raise BadInput(f"{name}: {e}") from None
    if not values:
        raise BadInput(f"{name} is empty")
    return values


@cli_errors
def bench(
    ctx: typer.Context,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    prompts: str = typer.Option(
        None, "--prompts", help='JSONL of {"prompt": ...}; default: built-in.'
    ),
    kind: str = typer.Option(
        "code",
        "--set",
        help="Built-in prompts: code, edit, all, or edit-sequence (successive edits of one "
        "file, each on the previous output; --prompts then names a JSONL of sequences).",
    ),
    limit: int = typer.Option(0, "--limit", help="Use only the first N prompts (0: all)."),
    ks: str = typer.Option("1,2,4,8,auto", "-k", help="Draft lengths to sweep, e.g. 1,2,4,auto."),
    temps: str = typer.Option("0,0.8", "--temp", help="Temperatures, e.g. 0,0.8."),
    top_p: float = typer.Option(0.95, "--top-p", help="top-p used when temperature > 0."),
    max_tokens: int = typer.Option(128, "-n", "--max-tokens", help="Tokens per generation."),
    repeats: int = typer.Option(3, "--repeats", help="Interleaved repeats; medians reported."),
    compare: str = typer.Option("mlx-lm", "--compare", help="mlx-lm or none."),
    lookup: bool = typer.Option(False, "--lookup", help="Add prompt-lookup and hybrid rows."),
    memory: bool = typer.Option(
        False,
        "--lookup-memory",
        help="Also add lookup rows with a lookup memory (empty at each repeat or sequence; "
        "implies --lookup).",
    ),
    draft_stop: bool = typer.Option(
        False, "--draft-stop", help="Also add auto rows whose draft stops per token."
    ),
    lookaheads: list[str] = typer.Option(
        [],
        "--lookahead",
        help="Also add lookahead-decoding rows: 'lookahead' (auto) or 'lookahead:w=W,n=N,g=G'; "
        "repeat the option for several.",
    ),
    mtp: bool = typer.Option(
        False, "--mtp", help="Also add rows drafted by the target's own MTP head (--head mtp)."
    ),
    head_name: str = typer.Option(
        None,
        "--head",
        help="Also add rows drafted by a head over the target, beside the draft model's: mtp, "
        "eagle3:PATH|ALIAS or dflash:PATH|ALIAS.",
    ),
    trees: str = typer.Option(
        "off,auto",
        "--tree",
        help="Comma-separated token-tree settings for the draft model's and a head's rows "
        "(with --lookup, theirs beside lookup too): off, auto, N, expand:N.",
    ),
    verifies: str = typer.Option(
        DEFAULT_VERIFY,
        "--verify",
        help="specmlx rows per acceptance rule: block, token or token,block (side by side; "
        "block rows are sampled only, greedy is the same under both).",
    ),
    seed: int = typer.Option(0, "--seed", help="Base seed (repeat r uses seed + r)."),
    json_out: str = typer.Option(None, "--json", help="Write rows, runs and environment here."),
    md_out: str = typer.Option(None, "--markdown", help="Write a Markdown table here."),
    plot_out: str = typer.Option(None, "--plot", help="Write a PNG plot here (matplotlib)."),
    overhead: bool = typer.Option(
        False,
        "--overhead",
        help="Measure only the host's work per token instead: specmlx against mlx-lm on a "
        "tiny random model (target and draft), k = 0, 2, 4, -n tokens, --repeats repeats.",
    ),
    hosts: HostsOpt = None,
    hostfile: HostfileOpt = None,
) -> None:
    """Benchmark target-only, specmlx and mlx-lm side by side in one process."""
    if overhead:
        _overhead(max_tokens, repeats, json_out)
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from ..bench import data as bench_data
    from ..bench import report as bench_report
    from ..bench import suite as b
    from ..core.sampling import SamplingParams
    from ..decoding.stream import encode_prompt
    from ..distributed.launch import join, launched
    from ..distributed.ranks import Watchdog, barrier
    from ..models.loading import load_head_over, load_pair
    from ..models.registry import load_registry
    from .display import bench_table

    settings = bench_data.BenchSettings(
        ks=_split(ks, K.of, "-k"),
        temps=_split(temps, float, "--temp"),
        top_p=top_p,
        max_tokens=max_tokens,
        repeats=repeats,
        compare_mlx_lm=compare == "mlx-lm",
        lookup=lookup or memory,
        memory=memory,
        draft_stop=draft_stop,
        lookaheads=[str(LookaheadSize.of(a)) for a in lookaheads],
        seed=seed,
        verifies=list(dict.fromkeys(_split(verifies, _rule_name, "--verify"))),
        trees=list(dict.fromkeys(_split(trees, lambda t: TreeSize.of(t, "--tree"), "--tree"))),
    )
    if compare not in ("mlx-lm", "none"):
        raise BadInput(f"--compare must be mlx-lm or none, got {compare!r}")
    if kind not in ("code", "edit", "all", "edit-sequence"):
        raise BadInput(f"--set must be code, edit, all or edit-sequence, got {kind!r}")
    for t in settings.temps:
        SamplingParams(temperature=t, top_p=top_p)  # raises BadInput for bad values
    if max_tokens <= 0 or repeats <= 0:
        raise BadInput("-n and --repeats must be > 0")
    sequences = kind == "edit-sequence"
    if sequences:
        rows = bench_data.load_sequences(prompts)
    else:
        rows = bench_data.load_prompts(prompts, kind if not prompts else "all")
    rows = rows[:limit] if limit > 0 else rows
    if (hosts or hostfile) and not launched():
        check_split(hosts, hostfile, target)
        raise typer.Exit(launch_command(ctx, "bench", hosts, hostfile))
    world = join()
    rev = bench_report.git_revision()  # the code that runs: the tree may move on meanwhile
    registry = load_registry()
    models = resolve_models(registry, target, draft, False, None)
    console, report = err_console(), out_console()
    if not world.leader:  # every rank runs the same sequence; rank 0 reports it
        console.quiet = report.quiet = True
        json_out = md_out = plot_out = None
    tgt, drf, shared = load_pair(
        models.target,
        models.draft,
        registry=registry,
        group=world.group if world.distributed else None,
        progress=lambda m: console.print(m, style="dim", soft_wrap=True, markup=False),
        lone=not draft_stop,  # (generations run one at a time)
    )
    watchdog = None
    if world.distributed:  # a rank that hangs ends every rank, with one line
        watchdog = Watchdog(rank_timeout(), lambda m: print_error(rank_prefix() + m))
        watchdog.beat("loading the models on the other ranks")
        barrier(world)
        watchdog.beat("benchmarking")
    head = None
    head_name = head_name or (MTP if mtp else None)
    if head_name and head_name != models.draft:  # the head's rows beside the draft model's
        say = lambda m: console.print(m, style="dim", soft_wrap=True, markup=False)  # noqa: E731
        loaded = load_head_over(tgt, head_name, registry, say)
        head = (loaded.spec.alias, loaded.model)
    todo = b.systems(drf.spec.alias if drf else None, settings, head[0] if head else None)
    generations = sum(len(r["edits"]) for r in rows) if sequences else len(rows)
    total = settings.repeats * generations * len(settings.temps) * len(todo)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    with progress:
        task = progress.add_task("warming up", total=total)

        def on_run(run):
            progress.update(task, advance=1, description=run.label[:40])
            if watchdog is not None:
                watchdog.beat()

        def encode(row):
            return encode_prompt(tgt.tokenizer, row["prompt"], chat=bool(row.get("chat")))

        draft_name, draft_model = (drf.spec.alias, drf.model) if drf else (None, None)
        benched = b.Benched(tgt.model, draft_model, draft_name, shared, world, head)
        if sequences:
            decode = tgt.tokenizer.decode
            result = b.bench_sequences(benched, rows, encode, decode, settings, on_run=on_run)
        else:
            result = b.bench(benched, rows, encode, settings, on_run=on_run)
    if watchdog is not None:
        watchdog.disarm()
    info = {"target": _model_info(tgt), "draft": _model_info(drf) if drf else None}
    result["environment"] = bench_report.environment(info, rev)
    result["environment"]["ranks"] = {"size": world.size, "backend": world.backend}
    result["settings"] = {
        **asdict(settings),
        "ks": [k.value for k in settings.ks],
        "prompts": prompts or f"built-in ({kind})",
        "n_prompts": len(rows),
    }
    report.print(bench_table(result))
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1))
    if md_out:
        Path(md_out).write_text(bench_report.to_markdown(result))
    if plot_out:
        bench_report.plot(result, plot_out)


def _overhead(max_tokens: int, repeats: int, json_out: str | None) -> None:
    from ..bench.overhead import measure
    from ..machine import blas_in_use
    from .display import overhead_table

    if max_tokens <= 1 or repeats <= 0:
        raise BadInput("--overhead needs -n > 1 and --repeats > 0")
    with err_console().status("timing") as status:
        rows = measure(tokens=max_tokens, repeats=repeats, on_step=status.update)
    report = out_console()
    report.print(overhead_table(rows))
    report.print(f"BLAS: {blas_in_use()}", style="dim", markup=False)
    if json_out:
        Path(json_out).write_text(json.dumps([asdict(r) for r in rows], indent=1))


def _rule_name(name: str) -> str:
    """A --verify value, checked where the engine checks it."""
    from ..core.acceptance import sampled_rule

    sampled_rule(name)
    return name


def _model_info(loaded) -> dict:
    return {
        "alias": loaded.spec.alias,
        "source": loaded.spec.source,
        "identity": loaded.identity,
        "label": loaded.spec.label,
        "dtype": loaded.spec.dtype,
        "bytes": loaded.nbytes,
    }
