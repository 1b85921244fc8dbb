"""`specmlx run`: one completion here, on ranks, or from a running server.

stdout carries only generated text (or one JSON object with --json), so pipelines work:
    cat file.py | specmlx run - >> file.py
"""

from __future__ import annotations

import io
import os
import stat
import sys
from dataclasses import replace
from pathlib import Path

import typer

from ..core.acceptance import DEFAULT_VERIFY
from ..core.stats import Stats
from ..distributed.launch import rank_prefix
from ..drafting.choosing.choosers import K
from ..drafting.choosing.tree_size import TreeSize
from ..errors import BadInput
from .common import (
    ApiKeyOpt,
    ContextOpt,
    DraftOpt,
    DraftStopOpt,
    HostfileOpt,
    HostsOpt,
    KOpt,
    LookupMemoryOpt,
    LookupOpt,
    MaxTokensOpt,
    MinPOpt,
    QuietOpt,
    SeedOpt,
    ServerOpt,
    ShowDraftOpt,
    StopOpt,
    TargetOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    TreeOpt,
    VerifyOpt,
    check_context,
    check_draft_stop,
    cli_errors,
    draft_spec,
    lookup_memory_for,
    rank_timeout,
    resolve_models,
)
from .display import err_console, print_error, print_warning
from .ranks import check_split, launch_command
from .render import Render


def read_prompt(prompt: str | None, piped: bool = True) -> str:
    """The prompt: PROMPT; stdin alone when PROMPT is '-' or absent; with both a PROMPT and
    text piped in (a pipe or a file on stdin, as `llm` and `ollama run` take them), the
    instruction first, a blank line, then the piped text. piped: look at stdin beside a
    PROMPT (a rank of `--hosts` does not: its stdin never ends)."""
    if prompt is not None and prompt != "-":
        if not piped or not _piped_in():
            return prompt
        data = _read_stdin()
        return f"{prompt}\n\n{data}" if data.strip() else prompt
    if sys.stdin is None or (sys.stdin.isatty() and prompt is None):
        raise BadInput("no prompt: give one as an argument or pipe it on stdin")
    return _read_stdin()


def _piped_in() -> bool:
    """Whether stdin holds text piped or redirected in: a pipe, a socket or a file (not a
    terminal, /dev/null or no stdin at all); CliRunner's stdin (no descriptor) counts."""
    if sys.stdin is None or sys.stdin.isatty():
        return False
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, io.UnsupportedOperation):
        return True  # an in-memory stream: what a test gives as input
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


def _read_stdin() -> str:
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"stdin is not valid UTF-8 (byte {e.start})") from None
    return data


@cli_errors
def run(
    ctx: typer.Context,
    prompt: str = typer.Argument(
        None,
        help="Prompt text; '-' or absent reads stdin. With text piped in too, the prompt "
        "is this, a blank line, then the piped text.",
    ),
    target: TargetOpt = None,
    draft: DraftOpt = None,
    lookup: LookupOpt = False,
    lookup_memory: LookupMemoryOpt = None,
    k: KOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    verify: VerifyOpt = None,
    draft_stop: DraftStopOpt = False,
    tree: TreeOpt = None,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    chat: bool = typer.Option(False, "--chat", help="Apply the tokenizer's chat template."),
    system: str = typer.Option(None, "--system", help="With --chat: a system message first."),
    suffix: str = typer.Option(
        None, "--suffix", help="Fill in the middle: the text after the cursor (PROMPT before)."
    ),
    suffix_file: Path = typer.Option(None, "--suffix-file", help="--suffix, read from a file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    quiet: QuietOpt = False,
    show_draft: ShowDraftOpt = False,
    context: ContextOpt = None,
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
    hosts: HostsOpt = None,
    hostfile: HostfileOpt = None,
) -> None:
    """Generate a completion: text on stdout, live stats and a summary on stderr."""
    from ..core.acceptance import sampled_rule
    from ..core.sampling import SamplingParams
    from ..decoding.session import Request
    from ..distributed.launch import join, launched

    params = SamplingParams(temp, top_p, top_k, min_p)  # validates before any loading
    if verify is not None:
        sampled_rule(verify)
    if max_tokens <= 0:
        raise BadInput(f"--max-tokens must be > 0, got {max_tokens}")
    # k and the tree setting parsed once, here, before any loading
    kk = K.of(k, "-k") if k is not None else None
    trees = TreeSize.of(tree, "--tree") if tree is not None else None
    if context is not None and context <= 0:
        raise BadInput(f"--context must be > 0, got {context}")
    text = read_prompt(prompt, piped=not launched())
    after = read_suffix(suffix, suffix_file)
    if after is not None and chat:
        raise BadInput("--suffix fills in the middle of raw text: drop --chat")
    if system is not None and not chat:
        raise BadInput("--system is a chat's system message: add --chat")
    if not text.strip() and not (after or "").strip():
        raise BadInput("the prompt is empty")
    console = err_console()
    render = Render(console, as_json, quiet, show_draft, str(kk) if kk is not None else "")
    # what this run asks, wherever the models are (the prompt's ids, k and the drafter are
    # filled in where the models are known)
    request = Request(
        sampling=params, max_tokens=max_tokens, seed=seed, stop=stop or [],
        verify=verify or DEFAULT_VERIFY, draft_stop=draft_stop,
    )  # fmt: skip
    if (hosts or hostfile) and not launched():
        if server:
            raise BadInput("--hosts/--hostfile start ranks here; --server sends to a server")
        check_draft_stop(None, draft_stop, ranks=True)
        raise typer.Exit(_launch_ranks(ctx, text, after, seed, hosts, hostfile, target))
    if server:
        local = target or context or lookup or draft_stop or trees is not None
        local = local or lookup_memory is not None
        if local or draft not in (None, "none", "lookup"):
            raise BadInput(
                "with --server the server's models run: drop --target, --context, --lookup, "
                "--lookup-memory, --draft-stop, --tree and --draft ALIAS (--draft none or "
                "lookup still choose how it drafts)"
            )
        # the server fills in what was not asked (its drafter, k and rule): those go raw
        asked = {"draft": draft, "k": kk, "verify": verify}
        _run_remote(request, text, after, chat, render, server, api_key, asked, system)
    else:
        _run_local(
            request, text, after, chat, render, system=system, target=target, draft=draft, lookup=lookup,
            k=kk, tree=trees, context=context, lookup_memory=lookup_memory, quiet=quiet,
            world=join(),
        )  # fmt: skip


def read_suffix(suffix: str | None, suffix_file: Path | None) -> str | None:
    """--suffix or the text of --suffix-file (UTF-8), or None."""
    if suffix is not None and suffix_file is not None:
        raise BadInput("give --suffix or --suffix-file, not both")
    if suffix_file is None:
        return suffix
    try:
        return suffix_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{suffix_file} is not valid UTF-8 (byte {e.start})") from None
    except OSError as e:
        raise BadInput(f"cannot read --suffix-file {suffix_file}: {e.strerror or e}") from None


def _run_local(
    request, text, suffix, chat, render, *, system, target, draft, lookup, k, tree, context,
    lookup_memory, quiet, world,
) -> None:  # fmt: skip
    """``request`` run here, on ``text`` (with ``suffix``: fill in the middle; ``chat``: the
    chat template, after ``system``); the rest is what the command line says of the models."""
    from ..decoding.fim import encode_infill, require_fim
    from ..decoding.session import Pair, Session
    from ..decoding.stream import encode_prompt
    from ..distributed.ranks import Lockstep, Watchdog, barrier, lost_peer, shared_seed
    from ..drafting.choosing.choosers import ChooserStore
    from ..drafting.lookup.memory import LookupMemory
    from ..models.loading import load_pair
    from ..models.registry import load_registry

    registry = load_registry()
    models = resolve_models(registry, target, draft, lookup, k, tree)
    keep = lookup_memory_for(models, lookup_memory)
    check_draft_stop(models, request.draft_stop, world.distributed)
    render.k_label = str(models.k)
    console = render.console
    quiet = quiet or not world.leader
    if not world.leader:  # only rank 0 writes: the others' text would repeat it
        render.quiet, render.as_json, render.live_ok = True, False, False
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of this rank
    say = (
        None
        if quiet
        else (lambda msg: console.print(msg, style="dim", soft_wrap=True, markup=False))
    )
    watchdog = None
    if world.distributed:
        watchdog = Watchdog(rank_timeout(), lambda m: print_error(rank_prefix() + m))
    tspec = registry.resolve(models.target)
    limit = context or registry.context_for(tspec, draft_spec(registry, models))
    # plan memory for what this run can reach: a token never takes less than a byte of text
    size = len(text.encode()) + len((suffix or "").encode())
    planned = min(limit, size + request.max_tokens + 64)
    tgt, drf, shared = load_pair(
        models.target, models.draft, registry=registry, context=planned, progress=say,
        group=world.group if world.distributed else None, lone=not request.draft_stop,
    )  # fmt: skip
    lockstep = None
    if world.distributed:
        watchdog.beat("loading the models on the other ranks")
        try:
            barrier(world)
        except RuntimeError as e:
            raise (lost_peer(e) or e) from None
        request.seed = shared_seed(world, request.seed)
        lockstep = Lockstep(world, beat=lambda: watchdog.beat("generating"))
    extra_eos: tuple[int, ...] = ()
    if suffix is not None:
        template = require_fim(tgt.tokenizer, drf.tokenizer if drf else None, tgt.spec.alias)
        ids = encode_infill(tgt.tokenizer, template, text, suffix)
        extra_eos = template.stops
    else:
        ids = encode_prompt(tgt.tokenizer, text, chat=chat, system=system)
    check_context(len(ids), request.max_tokens, limit, tgt.spec.alias)
    memory = None
    if keep:
        directory = LookupMemory.directory_for(tgt.tokenizer)
        memory = LookupMemory(directory, vocab_size=tgt.vocab_size, warn=print_warning)
    # adaptive k resumes from this machine's last run of the pair
    store = ChooserStore(warn=print_warning, persist=world.leader)
    session = Session(Pair.of(tgt, drf, shared), choosers=store, memory=memory, world=world)
    request = replace(
        request,
        prompt_ids=ids,
        k=models.k,
        drafter=models.drafter,
        extra_eos=extra_eos,
        tree=models.tree,
    )
    gen = session.start(request, lockstep=lockstep)
    stats = gen.stats
    responses = gen.text()
    parts = ([drf.spec.alias] if drf else []) + ([str(models.lookup)] if models.lookup else [])
    try:
        interrupted = render.stream(responses, stats)
        if lockstep is not None and not interrupted:
            lockstep.check()  # the last rounds too
            watchdog.disarm()
    except RuntimeError as e:
        raise (lost_peer(e) or e) from None
    gen.finish()
    where = {"load_s": tgt.load_seconds}
    ranks = None
    if world.distributed:
        where["ranks"] = f"{world.size} ({world.backend}), {_ms(stats)} per target pass"
        pass_s = stats.decode_s / stats.rounds if stats.rounds else None
        ranks = {"size": world.size, "backend": world.backend, "target_pass_s": pass_s}
    drafter_shown = " + ".join(parts) or "none"
    render.finish(stats, tgt.spec.alias, drafter_shown, where, interrupted)
    render.json(stats, tgt.spec.alias, drafter_shown, models.k.value, request, ranks=ranks)
    if interrupted:
        raise typer.Exit(130)


def _ms(stats: Stats) -> str:
    return f"{stats.decode_s / stats.rounds * 1000:.1f} ms" if stats.rounds else "-"


def _launch_ranks(ctx: typer.Context, text, suffix, seed, hosts, hostfile, target) -> int:
    """`specmlx run` as ranks: the prompt, suffix file and seed are resolved here, once."""
    check_split(hosts, hostfile, target)
    tail = []
    if suffix is not None and ctx.params.get("suffix_file") is not None:
        tail += ["--suffix", suffix]  # the ranks may not see this machine's files
    seed = seed if seed is not None else int.from_bytes(os.urandom(6), "little")
    # the prompt was read here (stdin reaches the ranks without an end), so it travels as
    # an argument
    if len(text.encode()) > 100_000:
        raise BadInput("with --hosts the prompt travels on the command line: 100 KB at most")
    return launch_command(ctx, "run", hosts, hostfile, [*tail, "--seed", str(seed), "--", text])


def _run_remote(
    request, text, suffix, chat, render, url: str, api_key, asked: dict, system: str | None
) -> None:
    """``request`` sent to the server at ``url``; asked: the options the server fills in
    when absent (draft, k as a choosers.K, verify: None where not given)."""
    from ..decoding.stream import chat_messages
    from ..serving.client import Remote, request_body, stream_remote

    num_draft = asked["k"].value if asked["k"] is not None else None
    body = request_body(request, asked["draft"], num_draft, asked["verify"])
    if chat:
        body["messages"] = chat_messages(text, system)
    else:
        body["prompt"] = text
        if suffix is not None:
            body["suffix"] = suffix
    stats, names = Stats(), {"model": "?", "drafter": "?"}
    pieces = stream_remote(Remote(url, api_key), body, stats, chat=chat, names=names)
    interrupted = render.stream(pieces, stats)
    pieces.close()  # an interrupted stream closes the connection: the server cancels it
    shown = f"{names['model']} (served by {url})"
    render.finish(stats, shown, names["drafter"], {"server": url}, interrupted)
    verify = names.get("verify") or asked["verify"] or "server default"
    shown_k = num_draft if num_draft is not None else "server default"
    render.json(stats, names["model"], names["drafter"], shown_k, request, verify)
    if interrupted:
        raise typer.Exit(130)
