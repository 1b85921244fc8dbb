"""The specmlx command line: parse, call the library, render with rich on stderr.

stdout carries only generated text (or one JSON object with --json), so pipelines work:
    cat file.py | specmlx run - >> file.py
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from functools import wraps
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from rich.markup import escape
from typer.core import TyperCommand

from . import __version__
from .acceptance import DEFAULT_VERIFY
from .display import err_console, live_line, print_error, print_warning, summary
from .distributed import leave, rank_prefix
from .errors import BadInput, SpecmlxError
from .machine import version
from .registry import MTP
from .stats import Stats

# Commands import the model-loading modules when they run, so that `--help`, `--version`
# and bad-usage errors answer without loading MLX, mlx-lm and transformers.

# options that run, serve and bench share (each command keeps its own default and wording
# where they differ)
TargetOpt = Annotated[
    str | None, typer.Option("--target", "-t", help="Target alias, path or hf repo.")
]
DraftOpt = Annotated[
    str | None,
    typer.Option("--draft", "-d", help="Draft alias/path, 'lookup' (prompt lookup), or 'none'."),
]
TempOpt = Annotated[float, typer.Option("--temp", help="Temperature; 0 is greedy.")]
TopPOpt = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].")]
TopKOpt = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")]
MinPOpt = Annotated[
    float, typer.Option("--min-p", help="Drop tokens below min_p x the top one (0: off).")
]
VerifyOpt = Annotated[
    str | None,
    typer.Option(
        "--verify",
        help="How sampled rounds check the drafts: 'block' (the block jointly, the default: "
        "same output distribution, never fewer kept on average) or 'token' (one by one).",
    ),
]
DraftStopOpt = Annotated[
    bool,
    typer.Option(
        "--draft-stop",
        help="With -k auto: the draft drafts in small chunks and stops within a round when its "
        "confidence says more drafts would not pay, per the cost model (up to 8).",
    ),
]
ContextOpt = Annotated[
    int | None,
    typer.Option("--context", help="Context limit (default: the models' own, from models.toml)."),
]


app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Lossless speculative decoding on MLX: a draft proposes, the target verifies.",
)
models_app = typer.Typer(help="List and fetch the models in models.toml.", no_args_is_help=True)
app.add_typer(models_app, name="models")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"specmlx {__version__} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')})")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print versions and exit."
    ),
) -> None:
    """specmlx: a cheap draft proposes k tokens, the target checks them in one pass."""


def cli_errors(fn):
    """Domain errors become one red stderr line and their exit code; Ctrl-C exits 130."""

    @wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except SpecmlxError as e:
            print_error(rank_prefix() + str(e))
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            err_console().print("[yellow]interrupted[/yellow]")
            raise typer.Exit(130) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence: no tracebacks
            if os.environ.get("SPECMLX_DEBUG"):
                raise
            err_console().print(
                f"[red]error:[/red] {type(e).__name__}: {e} (SPECMLX_DEBUG=1 for details)"
            )
            raise typer.Exit(1) from None

    return wrapper


_OPTION = re.compile(r"--?[A-Za-z][\w-]*(=.*)?", re.S)


class PromptCommand(TyperCommand):
    """A command whose PROMPT may start with '-' (an SQL or Lua comment, a diff hunk): such a
    prompt is not an option, and the error says how to pass it instead of "No such option"."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except Exception as e:
            # click's NoSuchOption (typer vendors click, so match it by name, not by class)
            name = getattr(e, "option_name", None)
            if type(e).__name__ != "NoSuchOption" or name is None or _OPTION.fullmatch(name):
                raise  # a mistyped option: click's message (with its suggestion) is right
            shown = " ".join(name.split())
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            print_error(
                f"the prompt {shown!r} starts with '-' and was read as an option; put -- "
                f'before it (specmlx {ctx.info_name} -- "$PROMPT") or pipe it on stdin'
            )
            ctx.exit(2)


def parse_k(text: str) -> int | str:
    """'auto' or an integer >= 0."""
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        raise BadInput(f"-k must be an integer >= 0 or 'auto', got {text!r}") from None
    if k < 0:
        raise BadInput(f"-k must be >= 0, got {k}")
    return k


def read_prompt(prompt: str | None) -> str:
    """PROMPT, or stdin when PROMPT is '-' or absent."""
    if prompt is not None and prompt != "-":
        return prompt
    if sys.stdin is None or (sys.stdin.isatty() and prompt is None):
        raise BadInput("no prompt: give one as an argument or pipe it on stdin")
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadInput(f"stdin is not valid UTF-8 (byte {e.start})") from None
    return data


@dataclass
class Models:
    """Which models run: target alias, draft alias (or None), lookup, k."""

    target: str
    draft: str | None
    lookup: bool
    k: int | str


def resolve_models(registry, target: str | None, draft: str | None, lookup: bool, k: str | None):
    """Fill in what the user did not say from the pairs and defaults in models.toml."""
    import mlx.core as mx

    pair = None
    if target is None:
        pair = registry.default_pair(cpu=mx.default_device() == mx.cpu)
        target = pair.target
    else:
        pair = next((p for p in registry.pairs.values() if p.target == target), None)
    if draft is None:
        draft = pair.draft if pair else "none"
    if draft == "lookup":
        draft, lookup = "none", True
    kk = parse_k(k) if k is not None else (pair.k if pair else "auto")
    return Models(target, None if draft == "none" else draft, lookup, kk)


HostsOpt = Annotated[
    str | None,
    typer.Option(
        "--hosts", help="Split the target over ranks: IPs, comma separated (localhost for local)."
    ),
]
HostfileOpt = Annotated[
    Path | None, typer.Option("--hostfile", help="Split the target over MLX's hostfile's hosts.")
]


@app.command(cls=PromptCommand)
@cli_errors
def run(
    ctx: typer.Context,
    prompt: str = typer.Argument(None, help="Prompt text; '-' or absent reads stdin."),
    target: TargetOpt = None,
    draft: DraftOpt = None,
    lookup: bool = typer.Option(False, "--lookup", help="Prompt lookup first, then the draft."),
    lookup_memory: bool = typer.Option(
        True,
        "--lookup-memory/--no-lookup-memory",
        help="With lookup: also look up (and keep) recent outputs, per tokenizer under "
        "$SPECMLX_HOME/lookup.",
    ),
    k: str = typer.Option(None, "-k", "--num-draft", help="Draft tokens per round, or 'auto'."),
    max_tokens: int = typer.Option(256, "-n", "--max-tokens", help="Tokens to generate."),
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    verify: VerifyOpt = None,
    draft_stop: DraftStopOpt = False,
    seed: int = typer.Option(None, "--seed", help="Random seed for reproducible sampling."),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the tokenizer's chat template."),
    suffix: str = typer.Option(
        None, "--suffix", help="Fill in the middle: the text after the cursor (PROMPT before)."
    ),
    suffix_file: Path = typer.Option(None, "--suffix-file", help="--suffix, read from a file."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No live line or summary."),
    show_draft: bool = typer.Option(False, "--show-draft", help="Colour draft-accepted text."),
    context: ContextOpt = None,
    server: str = typer.Option(
        None, "--server", envvar="SPECMLX_SERVER", help="Send it to a running `specmlx serve`."
    ),
    api_key: str = typer.Option(
        None, "--api-key", envvar="SPECMLX_API_KEY", help="The server's API key."
    ),
    hosts: HostsOpt = None,
    hostfile: HostfileOpt = None,
) -> None:
    """Generate a completion: text on stdout, live stats and a summary on stderr."""
    from .acceptance import sampled_rule
    from .distributed import join, launched
    from .sampling import SamplingParams

    params = SamplingParams(temp, top_p, top_k, min_p)  # validates before any loading
    if verify is not None:
        sampled_rule(verify)
    if max_tokens <= 0:
        raise BadInput(f"--max-tokens must be > 0, got {max_tokens}")
    if context is not None and context <= 0:
        raise BadInput(f"--context must be > 0, got {context}")
    text = read_prompt(prompt)
    after = read_suffix(suffix, suffix_file)
    if after is not None and chat:
        raise BadInput("--suffix fills in the middle of raw text: drop --chat")
    if not text.strip() and not (after or "").strip():
        raise BadInput("the prompt is empty")
    console = err_console()
    render = _Render(console, as_json, quiet, show_draft, k or "")
    job = RunInput(
        text, after, params, max_tokens, seed, stop or [], chat, verify, lookup_memory, draft_stop
    )
    if (hosts or hostfile) and not launched():
        if server:
            raise BadInput("--hosts/--hostfile start ranks here; --server sends to a server")
        raise typer.Exit(_launch_ranks(ctx, job, hosts, hostfile, target))
    if server:
        if target or (draft not in (None, "none", "lookup")) or context or lookup or draft_stop:
            raise BadInput(
                "with --server the server's models run: drop --target, --context, --lookup, "
                "--draft-stop and --draft ALIAS (--draft none or lookup still choose how it "
                "drafts)"
            )
        _run_remote(job, render, server, api_key, draft, k)
    else:
        _run_local(job, render, target, draft, lookup, k, context, quiet, join())


def allowed_hosts(host: str, loopback: bool, extra: list[str]) -> frozenset[str] | None:
    """The Host names a server on ``host`` answers to (None: any). On loopback: the loopback
    names and ``extra``; elsewhere (a key is required there) any, unless ``extra`` names them."""
    names = frozenset(n.strip().lower().strip("[]") for n in extra)
    if "*" in names:
        return None
    if loopback:
        return names | {"localhost", "127.0.0.1", "::1", host.lower()}
    return names | {host.lower()} if names else None


def _draft_spec(registry, models):
    """The draft model's spec (None: no draft model, or the target's own MTP head)."""
    return registry.resolve(models.draft) if models.draft not in (None, MTP) else None


def check_draft_stop(models, draft_stop: bool) -> None:
    """--draft-stop stops a draft model's drafting by the adaptive chooser's cost model."""
    if draft_stop and not (models.draft and models.k == "auto"):
        raise BadInput("--draft-stop needs a draft model and -k auto")
    if draft_stop and models.draft == MTP:
        raise BadInput("--draft-stop needs a draft model: an MTP head drafts the chooser's k")


@dataclass
class RunInput:
    """What `specmlx run` was asked to generate, wherever the models are."""

    text: str
    suffix: str | None
    params: object  # SamplingParams
    max_tokens: int
    seed: int | None
    stop: list[str]
    chat: bool
    verify: str | None = None  # None: DEFAULT_VERIFY here, the server's default there
    lookup_memory: bool = True  # with lookup, here: search and keep recent outputs too
    draft_stop: bool = False  # with auto k: per-token stopping of the draft model


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


def _run_local(job: RunInput, render, target, draft, lookup, k, context, quiet, world) -> None:
    from .choosers import ChooserStore
    from .distributed import Lockstep, Watchdog, barrier, lost_peer, shared_seed
    from .fim import encode_infill, require_fim
    from .loading import load_pair
    from .lookup import LookupMemory
    from .registry import load_registry
    from .session import Pair, Request, Session
    from .stream import encode_prompt

    registry = load_registry()
    models = resolve_models(registry, target, draft, lookup, k)
    check_draft_stop(models, job.draft_stop)
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
    limit = context or registry.context_for(tspec, _draft_spec(registry, models))
    # plan memory for what this run can reach: a token never takes less than a byte of text
    size = len(job.text.encode()) + len((job.suffix or "").encode())
    planned = min(limit, size + job.max_tokens + 64)
    tgt, drf, shared = load_pair(
        models.target, models.draft, registry=registry, context=planned, progress=say,
        group=world.group if world.distributed else None,
    )  # fmt: skip
    lockstep = None
    if world.distributed:
        watchdog.beat("loading the models on the other ranks")
        try:
            barrier(world)
        except RuntimeError as e:
            raise (lost_peer(e) or e) from None
        job.seed = shared_seed(world, job.seed)
        lockstep = Lockstep(world, beat=lambda: watchdog.beat("generating"))
    extra_eos: tuple[int, ...] = ()
    if job.suffix is not None:
        template = require_fim(tgt.tokenizer, drf.tokenizer if drf else None, tgt.spec.alias)
        ids = encode_infill(tgt.tokenizer, template, job.text, job.suffix)
        extra_eos = template.stops
    else:
        ids = encode_prompt(tgt.tokenizer, job.text, chat=job.chat)
    check_context(len(ids), job.max_tokens, limit, tgt.spec.alias)
    memory = None
    if models.lookup and job.lookup_memory:
        directory = LookupMemory.directory_for(tgt.tokenizer)
        memory = LookupMemory(directory, vocab_size=tgt.vocab_size, warn=print_warning)
    # adaptive k resumes from this machine's last run of the pair
    store = ChooserStore(warn=print_warning, persist=world.leader)
    session = Session(Pair.of(tgt, drf, shared), choosers=store, memory=memory, world=world)
    request = Request(
        sampling=job.params,
        num_draft=models.k,
        max_tokens=job.max_tokens,
        seed=job.seed,
        stop=job.stop,
        use_draft=drf is not None,
        lookup=models.lookup,
        extra_eos=extra_eos,
        verify=job.verify or DEFAULT_VERIFY,
        draft_stop=job.draft_stop,
    )
    gen = session.start(ids, request, lockstep=lockstep)
    stats = gen.stats
    responses = gen.text()
    parts = ([drf.spec.alias] if drf else []) + (["lookup"] if models.lookup else [])
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
    verify = job.verify or DEFAULT_VERIFY
    render.finish(stats, tgt.spec.alias, drafter_shown, where, interrupted)
    render.json(stats, tgt.spec.alias, drafter_shown, models.k, job, verify, ranks)
    if interrupted:
        raise typer.Exit(130)


def _ms(stats: Stats) -> str:
    return f"{stats.decode_s / stats.rounds * 1000:.1f} ms" if stats.rounds else "-"


def rank_timeout() -> float:
    """Seconds a rank waits for the others before giving up ($SPECMLX_RANK_TIMEOUT, 300)."""
    try:
        return float(os.environ.get("SPECMLX_RANK_TIMEOUT") or 300)
    except ValueError:
        raise BadInput("SPECMLX_RANK_TIMEOUT must be a number of seconds") from None


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


def _check_split(hosts, hostfile, target) -> None:
    """Before any rank starts: the hosts are well formed and the target can be split over
    them (both one-line errors)."""
    from .distributed import check_shardable, parse_hosts
    from .footprint import peek
    from .loading import shard_support
    from .registry import load_registry

    names = parse_hosts(hosts, hostfile)
    registry = load_registry()
    spec = registry.resolve(resolve_models(registry, target, None, False, None).target)
    config, _ = peek(spec)
    check_shardable(config, len(names), spec.alias, shard_support(config))


def _launch(
    ctx: typer.Context, command: str, hosts, hostfile, tail: list[str] = (), secret=None
) -> int:
    """Start this same command as ranks with mlx.launch; returns the exit code. ``secret``
    (the server's API key) goes to the ranks on stdin, never on a command line."""
    from .distributed import launch

    skip = {"hosts", "hostfile", "prompt", "suffix_file", "api_key"}
    skip |= {"seed"} if command == "run" else set()
    return launch([command, *_option_argv(ctx, skip), *tail], hosts, hostfile, secret=secret)


def read_secret(timeout: float = 60.0) -> str:
    """The first line of stdin (a rank's API key, sent by `launch`), waited for at most
    ``timeout`` seconds."""
    import select

    ready, _, _ = select.select([sys.stdin], [], [], timeout)
    line = sys.stdin.readline().strip() if ready else ""
    if not line:
        raise BadInput("the API key did not arrive on this rank's stdin")
    return line


def _launch_ranks(ctx: typer.Context, job: RunInput, hosts, hostfile, target) -> int:
    """`specmlx run` as ranks: the prompt, suffix file and seed are resolved here, once."""
    _check_split(hosts, hostfile, target)
    tail = []
    if job.suffix is not None and ctx.params.get("suffix_file") is not None:
        tail += ["--suffix", job.suffix]  # the ranks may not see this machine's files
    seed = job.seed if job.seed is not None else int.from_bytes(os.urandom(6), "little")
    # the prompt was read here (stdin reaches the ranks without an end), so it travels as
    # an argument
    if len(job.text.encode()) > 100_000:
        raise BadInput("with --hosts the prompt travels on the command line: 100 KB at most")
    return _launch(ctx, "run", hosts, hostfile, [*tail, "--seed", str(seed), "--", job.text])


def _option_argv(ctx: typer.Context, skip: set[str]) -> list[str]:
    """This command's options as given, back as arguments (for the ranks to run it too)."""
    out: list[str] = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if (
            param.name in skip
            or not getattr(param, "opts", None)
            or param.param_type_name != "option"
        ):
            continue
        if value is None or value == param.default or (param.multiple and not value):
            continue
        flag = max(param.opts, key=len)
        if param.is_flag:
            out.append(flag)
        elif param.multiple:
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


def _run_remote(job: RunInput, render, url: str, api_key, draft, k) -> None:
    from .client import Remote, stream_remote

    body: dict = {
        "max_tokens": job.max_tokens,
        "temperature": job.params.temperature,
        "top_p": job.params.top_p,
        "top_k": job.params.top_k,
        "min_p": job.params.min_p,
        "stop": job.stop or None,
        "seed": job.seed,
    }
    if draft is not None:
        body["draft"] = draft
    if k is not None:
        body["num_draft"] = parse_k(k)
    if job.verify is not None:
        body["verify"] = job.verify
    if job.chat:
        body["messages"] = [{"role": "user", "content": job.text}]
    else:
        body["prompt"] = job.text
        if job.suffix is not None:
            body["suffix"] = job.suffix
    stats, names = Stats(), {"model": "?", "drafter": "?"}
    pieces = stream_remote(Remote(url, api_key), body, stats, chat=job.chat, names=names)
    interrupted = render.stream(pieces, stats)
    pieces.close()  # an interrupted stream closes the connection: the server cancels it
    shown = f"{names['model']} (served by {url})"
    render.finish(stats, shown, names["drafter"], {"server": url}, interrupted)
    verify = names.get("verify") or job.verify or "server default"
    render.json(stats, names["model"], names["drafter"], k or "server default", job, verify)
    if interrupted:
        raise typer.Exit(130)


def check_context(prompt_tokens: int, max_tokens: int, limit: int, name: str) -> None:
    """BadInput, with the numbers, when the prompt plus max_tokens exceed the context."""
    if prompt_tokens + max_tokens > limit:
        raise BadInput(
            f"the prompt has {prompt_tokens} tokens and --max-tokens asks for {max_tokens} "
            f"more: {prompt_tokens + max_tokens} > the context of {limit} ({name}); shorten "
            "the prompt, lower --max-tokens or raise --context"
        )


class _Render:
    """Streams text to stdout and a live line to stderr; collects text and ids for --json."""

    def __init__(self, console, as_json, quiet, show_draft, k_label):
        self.console, self.as_json, self.quiet, self.k_label = console, as_json, quiet, k_label
        self.colour = show_draft and sys.stdout.isatty()
        self.text, self.tokens = "", []
        # a live line only where it cannot tangle with the text: stderr is a terminal, stdout not
        self.live_ok = not quiet and console.is_terminal and (as_json or not sys.stdout.isatty())

    def stream(self, responses, stats) -> bool:
        """Write each response's text; True when Ctrl-C stopped it (what came is kept). A
        closed stdout (| head) ends the command quietly with exit code 0."""
        live = Live(
            console=self.console, transient=True, refresh_per_second=8, redirect_stdout=False
        )
        try:
            with live if self.live_ok else _Null():
                for r in responses:
                    self.text += r.text
                    if r.token is not None:
                        self.tokens.append(r.token)
                    if not self.as_json and r.text:
                        colour = self.colour and r.from_draft
                        sys.stdout.write(f"\x1b[32m{r.text}\x1b[0m" if colour else r.text)
                        sys.stdout.flush()
                    if self.live_ok:
                        live.update(live_line(stats, self.k_label))
        except KeyboardInterrupt:
            return True
        except BrokenPipeError:
            # the reader went away: end quietly, and keep Python's exit flush silent
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
        return False

    def finish(self, stats, target, draft_name, where: dict, interrupted: bool = False) -> None:
        if not self.as_json and self.text and not self.text.endswith("\n"):
            try:
                sys.stdout.write("\n")
                sys.stdout.flush()
            except BrokenPipeError:
                pass
        if not self.quiet or interrupted:
            self.console.print(summary(stats, target=target, draft=draft_name, **where))

    def json(self, stats, target, draft_name, k, job, verify: str, ranks: dict | None = None):
        """The --json object on stdout (nothing without --json); ``ranks`` when distributed."""
        if not self.as_json:
            return
        out = {
            "text": self.text,
            "tokens": self.tokens,
            "stats": stats.as_dict(),
            "target": target,
            "draft": draft_name,
            "k": k,
            "temperature": job.params.temperature,
            "seed": job.seed,
            "verify": verify,
        }
        if ranks is not None:
            out["ranks"] = ranks
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@app.command()
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
    context: ContextOpt = None,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8080, "--port", help="Port to listen on."),
    api_key: str = typer.Option(
        None, "--api-key", envvar="SPECMLX_API_KEY", help="Require this Bearer token."
    ),
    public: bool = typer.Option(
        False, "--public-without-key", help="Allow a non-loopback --host without --api-key."
    ),
    max_queue: int = typer.Option(16, "--max-queue", help="Requests that may wait (then 503)."),
    prompt_cache: str = typer.Option(
        "4GB", "--prompt-cache", help="Memory for KV caches kept across requests (0: off)."
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
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No loading progress."),
    grace: float = typer.Option(
        10.0,
        "--shutdown-grace",
        help="Seconds the running request gets to finish on SIGTERM or Ctrl-C (queued ones "
        "get a 503 at once).",
    ),
    api_key_stdin: bool = typer.Option(False, "--api-key-stdin", hidden=True),
    hosts: HostsOpt = None,
    hostfile: HostfileOpt = None,
) -> None:
    """Load the pair once and serve OpenAI-compatible completions, chat and /infill."""
    import ipaddress
    import signal

    from .acceptance import sampled_rule
    from .distributed import Watchdog, barrier, join, launched
    from .footprint import parse_size
    from .loading import load_pair
    from .registry import load_registry
    from .sampling import SamplingParams
    from .serve import ServerSettings, create_app, run_server
    from .worker import Worker

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
    if context is not None and context <= 0:
        raise BadInput(f"--context must be > 0, got {context}")
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
        _check_split(hosts, hostfile, target)
        tail = ["--api-key-stdin"] if api_key else []  # the key travels on stdin
        raise typer.Exit(_launch(ctx, "serve", hosts, hostfile, tail, secret=api_key))
    world = join()
    registry = load_registry()
    models = resolve_models(registry, target, draft, False, k)
    check_draft_stop(models, draft_stop)
    console = err_console()
    quiet = quiet or not world.leader
    watchdog = fatal = None
    if world.distributed:  # a rank that hangs or dies ends every rank, with one line

        def fatal(message: str) -> None:
            print_error(rank_prefix() + message)
            leave(1)

        watchdog = Watchdog(rank_timeout(), lambda m: worker.fail(m) or print_error(m))
    say = None if quiet else (lambda m: console.print(m, style="dim", soft_wrap=True, markup=False))
    tspec = registry.resolve(models.target)
    limit = context or registry.context_for(tspec, _draft_spec(registry, models))
    tgt, drf, shared = load_pair(
        models.target,
        models.draft,
        registry=registry,
        context=limit,
        reserve=cache_budget,
        group=world.group if world.distributed else None,
        progress=say,
    )
    worker = Worker(tgt, drf, shared, max_queue=max_queue, cache_budget=cache_budget,
                    warn=print_warning, world=world, lookup_memory=lookup_memory,
                    draft_stop=draft_stop, watchdog=watchdog, fatal=fatal)  # fmt: skip
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
    drafter = "model" if drf else ("lookup" if models.lookup else "none")
    settings = ServerSettings(
        model_name=tgt.spec.alias,
        context=limit,
        max_tokens=max_tokens,
        sampling=params,
        num_draft=models.k if drafter != "none" else 0,
        drafter=drafter,
        api_key=api_key,
        max_body=body_limit,
        verify=verify,
        hosts=host_names,
    )
    shown = f"[{host}]" if ":" in host else host
    draft_name = drf.spec.alias if drf else drafter

    def ready() -> None:
        console.print(
            f"[green]specmlx serve[/green] listening on http://{shown}:{port}  "
            f"({tgt.spec.alias} ← {draft_name}, k {settings.num_draft}, context {limit}"
            + (f", {world.size} ranks" if world.distributed else "")
            + "); Ctrl-C stops",
            soft_wrap=True,
        )

    run_server(create_app(worker, settings, on_ready=ready), host, port, grace_s=grace)
    console.print("specmlx serve: stopped", style="dim")
    if world.distributed:
        leave(0)


@models_app.command("list")
@cli_errors
def models_list() -> None:
    """Aliases, sources, sizes and whether each is present locally."""
    from .display import models_table
    from .registry import load_registry

    err_console().print(models_table(load_registry()))


@models_app.command("pull")
@cli_errors
def models_pull(alias: str = typer.Argument(..., help="Alias to download or quantize.")) -> None:
    """Download a model's files into the local cache; an alias with `quantize` is then loaded
    (after the memory check) to quantize it once and cache the result."""
    from .footprint import plan_memory, require_fit
    from .loading import load_model
    from .registry import load_registry
    from .sources import fetch

    console = err_console()
    say = lambda m: console.print(m, style="dim", soft_wrap=True, markup=False)  # noqa: E731
    spec = load_registry().resolve(alias)
    if not spec.quantize:
        path = fetch(spec, progress=say)
        console.print(f"[green]ready:[/green] {alias} ({path})")
        return
    require_fit(plan_memory(spec, None, 0, progress=say), spec, None)
    loaded = load_model(spec, progress=say)
    console.print(f"[green]ready:[/green] {alias} ({loaded.nbytes / 1e9:.2f} GB quantized)")


@models_app.command("build")
@cli_errors
def models_build(
    name: str = typer.Argument(
        ..., help="What to build: cpu-demo, cpu-distilled (or one of their aliases)."
    ),
    force: bool = typer.Option(False, "--force", help="Rebuild even if it is complete."),
) -> None:
    """Build a stand-in that specmlx makes itself from SmolLM2: the CPU demo pair, or the
    distilled CPU pair (the demo target and a 4-block student trained for it)."""
    from .registry import BUILDS, load_registry
    from .standin import build_demo, describe

    registry = load_registry()
    spec = registry.models.get(name)
    builder = spec.build if spec is not None and spec.build else name
    if builder not in BUILDS:
        raise BadInput(f"nothing to build called {name!r}; known: {', '.join(BUILDS)}")
    console = err_console()
    say = lambda m: console.print(m, style="dim", soft_wrap=True, markup=False)  # noqa: E731
    facts = build_demo(force=force and builder == "cpu-demo", progress=say)
    if not facts["built"]:
        say(f"already built: {Path(facts['target']).parent} (--force rebuilds)")
    for line in describe(facts):
        console.print(line, soft_wrap=True, markup=False)
    if builder == "cpu-distilled":
        _build_distilled(registry, force, console, say)
    console.print(f"[green]ready:[/green] {builder}")


def _build_distilled(registry, force: bool, console, say) -> None:
    """The distilled CPU pair's draft: SmolLM2-135M (the demo target's logits) as teacher,
    CPU_DISTILLED's run on the standard library; an interrupted build resumes."""
    import mlx.core as mx

    from .distill import CPU_DISTILLED, CPU_RATES, cost_seconds, distill, distilled_dir, is_done
    from .loading import load_model

    out = distilled_dir()
    if is_done(out) and not force:
        say(f"already built: {out} (--force rebuilds)")
        _distill_summary(out, console)
        return
    c = CPU_DISTILLED
    resume = (out / "checkpoint" / "state.json").is_file() and not force
    say(
        f"distilling {out}: {c.layers} of SmolLM2-135M's 30 blocks on the standard library's "
        f"source ({c.data_tokens} tokens labelled, {c.steps} steps of {c.batch} x {c.seq_len}); "
        f"about 0.2 GB float32 on disk, about {cost_seconds(c, CPU_RATES) / 60:.0f} min on a "
        f"2-core x86 CPU{' (resuming)' if resume else ''}"
    )
    teacher = load_model(registry.resolve("smollm2-135m"), progress=say)
    teacher.model.set_dtype(mx.float32)  # the demo target's weights, at its precision
    _show_distill(distill(teacher, out, c, "stdlib", resume=resume, force=True), console)
    _distill_summary(out, console)


def _show_distill(events, console) -> dict:
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


def _distill_summary(out: Path, console) -> None:
    facts = json.loads((out / "distill.json").read_text())
    first, last = facts["evals"][0], facts["evals"][-1]
    console.print(
        f"student: {len(facts['picks'])} of {facts['target_layers']} blocks "
        f"(from {facts['picks']}), {facts['student_params'] / 1e6:.0f}M params, "
        f"{facts['trained_params'] / 1e6:.0f}M trained, {facts['train_tokens']} tokens, "
        f"{facts['seconds'] / 60:.1f} min",
        soft_wrap=True,
        markup=False,
    )
    console.print(
        f"held-out: greedy agreement {first['greedy']:.1%} -> {last['greedy']:.1%}, "
        f"alpha (T = 1) {first['alpha']:.1%} -> {last['alpha']:.1%}, "
        f"KL {first['kl']:.3f} -> {last['kl']:.3f}",
        soft_wrap=True,
        markup=False,
    )
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


@app.command()
@cli_errors
def distill(
    target: str = typer.Option(..., "--target", "-t", help="Target (teacher) alias or path."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory for the student model."),
    layers: int = typer.Option(4, "--layers", help="The student's blocks."),
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
    L of its blocks, trained on its own next-token distributions; writes an MLX model dir
    and a models.toml that pairs it with the target."""
    from .distill import DistillConfig, data_files, is_done, registry_entry
    from .distill import distill as run_distill
    from .loading import load_model
    from .paths import atomic_write
    from .registry import load_registry

    config = DistillConfig(
        layers=layers, init=init, loss=loss, data_from=data_from, top_k=top_k,
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
        _show_distill(run_distill(loaded, out, config, data, resume=resume, force=force), console)
    except KeyboardInterrupt:
        if (out / "checkpoint").is_dir():
            say(f"stopped; the last checkpoint is in {out}: --resume continues from it")
        raise
    assert is_done(out)
    label = f"distilled from {spec.alias}: {config.layers} blocks, {config.steps} steps"
    atomic_write(out / "models.toml", registry_entry(alias, out, tname, source, label))
    _distill_summary(out, console)
    console.print(f"[green]ready:[/green] {escape(str(out))}", soft_wrap=True)
    console.print(
        f"  SPECMLX_MODELS={out / 'models.toml'} specmlx run --target {tname} --draft {alias} "
        "'def fib(n):'",
        soft_wrap=True,
        markup=False,
    )


def _split(text: str, convert, name: str) -> list:
    try:
        values = [convert(v.strip()) for v in text.split(",") if v.strip()]
    except (ValueError, BadInput) as e:
        raise BadInput(f"{name}: {e}") from None
    if not values:
        raise BadInput(f"{name} is empty")
    return values


@app.command()
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
    mtp: bool = typer.Option(
        False, "--mtp", help="Also add rows drafted by the target's own MTP head (--draft mtp)."
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

    from . import bench as b
    from . import bench_data, bench_report
    from .display import bench_table
    from .distributed import Watchdog, barrier, join, launched
    from .loading import load_head, load_pair
    from .registry import load_registry
    from .sampling import SamplingParams
    from .stream import encode_prompt

    settings = bench_data.BenchSettings(
        ks=_split(ks, parse_k, "-k"),
        temps=_split(temps, float, "--temp"),
        top_p=top_p,
        max_tokens=max_tokens,
        repeats=repeats,
        compare_mlx_lm=compare == "mlx-lm",
        lookup=lookup or memory,
        memory=memory,
        draft_stop=draft_stop,
        seed=seed,
        verifies=list(dict.fromkeys(_split(verifies, _rule_name, "--verify"))),
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
        _check_split(hosts, hostfile, target)
        raise typer.Exit(_launch(ctx, "bench", hosts, hostfile))
    world = join()
    rev = bench_report.git_revision()  # the code that runs: the tree may move on meanwhile
    registry = load_registry()
    models = resolve_models(registry, target, draft, False, None)
    console = err_console()
    if not world.leader:  # every rank runs the same sequence; rank 0 reports it
        console.quiet = True
        json_out = md_out = plot_out = None
    tgt, drf, shared = load_pair(
        models.target,
        models.draft,
        registry=registry,
        group=world.group if world.distributed else None,
        progress=lambda m: console.print(m, style="dim", soft_wrap=True, markup=False),
    )
    watchdog = None
    if world.distributed:  # a rank that hangs ends every rank, with one line
        watchdog = Watchdog(rank_timeout(), lambda m: print_error(rank_prefix() + m))
        watchdog.beat("loading the models on the other ranks")
        barrier(world)
        watchdog.beat("benchmarking")
    head = None
    if mtp and models.draft != MTP:  # the head's rows beside the draft model's
        say = lambda m: console.print(m, style="dim", soft_wrap=True, markup=False)  # noqa: E731
        loaded = load_head(tgt, say)
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

        common = dict(
            draft_name=drf.spec.alias if drf else None, shared=shared, world=world, head=head
        )
        draft_model = drf.model if drf else None
        if sequences:
            decode = tgt.tokenizer.decode
            result = b.bench_sequences(
                tgt.model, draft_model, rows, encode, decode, settings, on_run=on_run, **common
            )
        else:
            result = b.bench(
                tgt.model, draft_model, rows, encode, settings, on_run=on_run, **common
            )
    if watchdog is not None:
        watchdog.disarm()
    info = {"target": _model_info(tgt), "draft": _model_info(drf) if drf else None}
    result["environment"] = bench_report.environment(info, rev)
    result["environment"]["ranks"] = {"size": world.size, "backend": world.backend}
    result["settings"] = {
        **asdict(settings),
        "prompts": prompts or f"built-in ({kind})",
        "n_prompts": len(rows),
    }
    console.print(bench_table(result))
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1))
    if md_out:
        Path(md_out).write_text(bench_report.to_markdown(result))
    if plot_out:
        bench_report.plot(result, plot_out)


def _overhead(max_tokens: int, repeats: int, json_out: str | None) -> None:
    from .display import overhead_table
    from .machine import blas_in_use
    from .overhead import measure

    if max_tokens <= 1 or repeats <= 0:
        raise BadInput("--overhead needs -n > 1 and --repeats > 0")
    console = err_console()
    with console.status("timing") as status:
        rows = measure(tokens=max_tokens, repeats=repeats, on_step=status.update)
    console.print(overhead_table(rows))
    console.print(f"BLAS: {blas_in_use()}", style="dim")
    if json_out:
        Path(json_out).write_text(json.dumps([asdict(r) for r in rows], indent=1))


def _rule_name(name: str) -> str:
    """A --verify value, checked where the engine checks it."""
    from .acceptance import sampled_rule

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
