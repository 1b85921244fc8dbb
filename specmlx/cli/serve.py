"""`specmlx serve`: the checks made before loading, the pair loaded once, the server run
(and its ranks, each following rank 0)."""

from __future__ import annotations

import os

import typer

from ..core.acceptance import DEFAULT_VERIFY
from ..decoding.session import DrafterChoice
from ..distributed.launch import leave, rank_prefix
from ..drafting.choosing.choosers import K
from ..drafting.choosing.tree_size import TreeSize
from ..drafting.lookup.kinds import SUFFIX
from ..errors import BadInput, SpecmlxError
from .common import (
    ContextOpt,
    DraftOpt,
    DraftStopOpt,
    HostfileOpt,
    HostsOpt,
    MinPOpt,
    TargetOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    TreeOpt,
    VerifyOpt,
    check_draft_stop,
    cli_errors,
    draft_spec,
    rank_timeout,
    resolve_models,
)
from .display import err_console, print_error, print_warning
from .ranks import check_split, launch_command, read_secret


def allowed_hosts(host: str, loopback: bool, extra: list[str]) -> frozenset[str] | None:
    """The Host names a server on ``host`` answers to (None: any). On loopback: the loopback
    names and ``extra``; elsewhere (a key is required there) any, unless ``extra`` names them."""
    names = frozenset(n.strip().lower().strip("[]") for n in extra)
    if "*" in names:
        return None
    if loopback:
        return names | {"localhost", "127.0.0.1", "::1", host.lower()}
    return names | {host.lower()} if names else None


MAX_BATCH_DEFAULT = 8  # the most rows the default batch takes


def batch_rows(
    target, draft, context: int, reserve: int, asked: int | None, shards: int = 1
) -> tuple[int, int]:
    """(rows the server may batch, bytes of KV caches one more row needs) from the memory
    plan: each row may grow to ``context`` tokens (a sliding window's layers too: a batch's
    rows keep every key, core.batch_caches); with the target over ``shards`` ranks, per rank.
    ``asked`` (--max-batch) past what fits is refused by name; None takes what fits, up to
    MAX_BATCH_DEFAULT."""
    from ..models.footprint import gb_text, plan_memory

    plan = plan_memory(target, draft, context, reserve=reserve, batched=True, shards=shards)
    per_row = plan.kv_bytes - reserve
    room = plan.available_bytes - plan.total_bytes
    fit = 1 + room // per_row if per_row > 0 and room > 0 else 1
    if asked is not None and asked > fit:
        raise BadInput(
            f"--max-batch {asked}: {asked} rows of {context} tokens need "
            f"{gb_text(asked * per_row)} of KV caches beside the weights; {fit} fit in "
            f"{gb_text(plan.available_bytes)} ({plan.available_from})"
        )
    return (asked if asked is not None else max(1, min(fit, MAX_BATCH_DEFAULT))), per_row


def check_port(host: str, port: int) -> None:
    """BadInput when ``host``:``port`` cannot be listened on (in use, or no such address)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            raise BadInput(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


@cli_errors
def serve(
    ctx: typer.Context,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    k: str = typer.Option(None, "-k", "--num-draft", help="Default draft tokens per round."),
    max_tokens: int = typer.Option(256, "-n", "--max-tokens", help="Default tokens a request."),
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    verify: VerifyOpt = None,
    draft_stop: DraftStopOpt = False,
    tree: TreeOpt = None,
    context: ContextOpt = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    api_key: str = typer.Option(
        None, "--api-key", envvar="SPECMLX_API_KEY", help="Require this Bearer token."
    ),
    public: bool = typer.Option(
        False, "--public-without-key", help="Allow a non-loopback --host without --api-key."
    ),
    max_queue: int = typer.Option(
        16, "--max-queue", help="Requests that may wait while every batch row is taken (then 503)."
    ),
    prompt_cache: str = typer.Option(
        "4GB", "--prompt-cache", help="Memory for KV caches kept across requests (0: off)."
    ),
    cache_reuse: int = typer.Option(
        0,
        "--cache-reuse",
        help="Also reuse cached runs of at least N tokens that a prompt has at another "
        "position, their keys moved there (llama-server's --cache-reuse; llama.vim asks for "
        "256). Not a fresh prefill's cache: past the first layer a moved run keeps the "
        "context it was computed in, so text can differ. 0: off.",
    ),
    max_body: str = typer.Option("16MB", "--max-body", help="Largest request body (then 413)."),
    allow_host: list[str] = typer.Option(
        [],
        "--allow-host",
        help="A Host header name requests may carry besides the loopback ones (repeat it; "
        "'*': any). A server on loopback answers only to loopback names by default, so a web "
        "page cannot reach it by rebinding its own name.",
    ),
    lookup_memory: bool = typer.Option(
        True,
        "--lookup-memory/--no-lookup-memory",
        help="Lookup requests also search (and keep) recent outputs, per tokenizer under "
        "$SPECMLX_HOME/lookup.",
    ),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No loading progress and no access log (errors still)."
    ),
    log_format: str = typer.Option(
        "text",
        "--log-format",
        help="The server's log on stderr, a line per request: text, or json (one object a "
        "line, for tools).",
    ),
    grace: float = typer.Option(
        10.0,
        "--shutdown-grace",
        help="Seconds the running request gets to finish on SIGTERM or Ctrl-C (queued ones "
        "get a 503 at once).",
    ),
    max_batch: int | None = typer.Option(
        None,
        "--max-batch",
        help="Requests decoded together, one target pass a round (default: what the memory "
        "plan fits, up to 8; 1: one at a time).",
    ),
    api_key_stdin: bool = typer.Option(False, "--api-key-stdin", hidden=True),
    hosts: HostsOpt = None,
    hostfile: HostfileOpt = None,
) -> None:
    """Load the pair once and serve OpenAI-compatible completions, chat and /infill."""
    import ipaddress
    import signal

    from rich.markup import escape

    from ..core.acceptance import sampled_rule
    from ..core.sampling import SamplingParams
    from ..distributed.launch import join, launched
    from ..distributed.ranks import Watchdog, barrier
    from ..drafting.trees.expand import expand_refusal
    from ..models.footprint import parse_size
    from ..models.loading import load_pair
    from ..models.registry import load_registry
    from ..serving import access_log
    from ..serving.serve import ServerSettings, create_app, run_server
    from ..serving.worker import Worker

    params = SamplingParams(temp, top_p, top_k, min_p)
    verify = verify or DEFAULT_VERIFY
    sampled_rule(verify)
    if api_key_stdin and launched():  # a rank: the key came on stdin, never in argv
        api_key = read_secret() if os.environ.get("MLX_RANK") in (None, "0") else None
    if max_tokens <= 0 or max_queue < 0 or not 0 <= port < 65536 or not grace > 0:
        raise BadInput(
            "--max-tokens must be > 0, --max-queue >= 0, --port in 0..65535 and "
            "--shutdown-grace > 0"
        )
    if log_format not in ("text", "json"):
        raise BadInput(f"--log-format must be text or json, got {log_format!r}")
    if context is not None and context <= 0:
        raise BadInput(f"--context must be > 0, got {context}")
    if max_batch is not None and max_batch < 1:
        raise BadInput(f"--max-batch must be >= 1, got {max_batch}")
    if cache_reuse < 0:
        raise BadInput(f"--cache-reuse must be >= 0, got {cache_reuse}")
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not loopback and not (api_key or api_key_stdin) and not public:
        raise BadInput(
            f"--host {host} is reachable from other machines: set --api-key (or "
            "SPECMLX_API_KEY), or say --public-without-key"
        )
    cache_budget, body_limit = parse_size(prompt_cache), parse_size(max_body)
    host_names = allowed_hosts(host, loopback, allow_host)
    if not launched() or os.environ.get("MLX_RANK") in (None, "0"):
        check_port(host, port)  # before minutes of loading, not after
    if (hosts or hostfile) and not launched():
        check_draft_stop(None, draft_stop, ranks=True)
        check_split(hosts, hostfile, target)
        tail = ["--api-key-stdin"] if api_key else []  # the key travels on stdin
        raise typer.Exit(launch_command(ctx, "serve", hosts, hostfile, tail, secret=api_key))
    world = join()
    registry = load_registry()
    models = resolve_models(
        registry, target, draft, False, K.of(k, "-k") if k is not None else None,
        TreeSize.of(tree, "--tree") if tree is not None else None,
    )  # fmt: skip
    check_draft_stop(models, draft_stop, world.distributed)
    console = err_console()
    quiet = quiet or not world.leader
    watchdog = fatal = None
    if world.distributed:  # a rank that hangs or dies ends every rank, with one line

        def fatal(message: str) -> None:
            print_error(rank_prefix() + message)
            leave(1)

        watchdog = Watchdog(rank_timeout(), lambda m: worker.fail(m) or print_error(m))
    # the server's log on stderr: a line per request and its failures; with json, every
    # line from here on is one JSON object (the loading progress and warnings too)
    log = access_log.install(log_format, access=not quiet)
    json_log = log_format == "json"
    warn = log.warning if json_log else print_warning
    say = None if quiet else (lambda m: console.print(m, style="dim", soft_wrap=True, markup=False))
    if json_log and not quiet:
        say = log.info
    tspec = registry.resolve(models.target)
    limit = context or registry.context_for(tspec, draft_spec(registry, models))
    rows, per_row = batch_rows(tspec, draft_spec(registry, models), limit, cache_budget,
                               max_batch, world.size)  # fmt: skip
    tgt, drf, shared = load_pair(
        models.target,
        models.draft,
        registry=registry,
        context=limit,
        reserve=cache_budget + (rows - 1) * per_row,  # the batch's other rows' KV caches
        group=world.group if world.distributed else None,
        progress=say,
    )
    why = expand_refusal(drf.model if drf else None, draft_stop)
    if models.tree.expand and why:  # (its rows would take chains unsaid)
        raise BadInput(f"--tree {models.tree}: {why}")
    worker = Worker(tgt, drf, shared, max_queue=max_queue, cache_budget=cache_budget,
                    warn=warn, world=world, lookup_memory=lookup_memory,
                    draft_stop=draft_stop, watchdog=watchdog, fatal=fatal,
                    max_batch=rows, cache_reuse=cache_reuse, tree=models.tree)  # fmt: skip
    if worker.batch_refused and max_batch is not None and not quiet:  # (asked for, not had)
        warn(f"--max-batch {max_batch}: one request at a time, {worker.batch_refused}")
    if cache_reuse and worker.cache.refused and world.leader:
        warn(f"--cache-reuse {cache_reuse}: only common prefixes are reused, "
             f"{worker.cache.refused}")  # fmt: skip
    if world.distributed:
        watchdog.beat("loading the models on the other ranks")
        barrier(world)
        watchdog.idle()  # between requests nothing is expected of the other ranks
        if not world.leader:  # rank 0 serves; this rank runs its requests in step
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # it stops when rank 0 says so
            try:
                worker.follow()
            except SpecmlxError as e:
                fatal(str(e))
            leave(0)
    # (with a draft model --lookup is not a server's default: a request asks model+lookup)
    drafter = DrafterChoice(True) if drf else DrafterChoice(False, models.lookup)
    settings = ServerSettings(
        model_name=tgt.spec.alias,
        context=limit,
        max_tokens=max_tokens,
        sampling=params,
        k=models.k if drafter.model or drafter.lookup else K(0),
        drafter=drafter,
        api_key=api_key,
        max_body=body_limit,
        verify=verify,
        hosts=host_names,
        tree=models.tree,
        lookup=models.lookup or SUFFIX,
    )
    shown = f"[{host}]" if ":" in host else host
    draft_name = drf.spec.alias if drf else drafter

    def ready() -> None:
        said = (
            f"listening on http://{shown}:{port}  "
            f"({tgt.spec.alias} ← {draft_name}, k {settings.k}, context {limit}"
            + (f", {world.size} ranks" if world.distributed else "")
            + (
                f", batches of up to {rows}"
                if worker.max_batch > 1 and not worker.batch_refused
                else ""
            )
            + "); Ctrl-C stops"
        )
        if json_log:
            log.info(f"specmlx serve {said}")
        else:
            console.print(f"[green]specmlx serve[/green] {escape(said)}", soft_wrap=True)

    run_server(create_app(worker, settings, on_ready=ready), host, port, grace_s=grace)
    if json_log:
        log.info("specmlx serve: stopped")
    else:
        console.print("specmlx serve: stopped", style="dim")
    if world.distributed:
        leave(0)
