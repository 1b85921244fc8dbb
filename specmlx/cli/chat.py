"""`specmlx chat`: a prompt loop with the pair loaded once (or a running server's), each
reply streamed to stdout; notes, a stats line after each reply and errors go to stderr.

Each turn prefills only its new message: the conversation's caches are kept between turns
(decoding/conversation.py), and with --server the server's prompt cache does the same.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import typer

from ..core.acceptance import DEFAULT_VERIFY
from ..core.stats import Stats
from ..drafting.choosing.choosers import K
from ..drafting.choosing.tree_size import TreeSize
from ..errors import BadInput, SpecmlxError
from ..paths import specmlx_home
from .common import (
    ApiKeyOpt,
    ContextOpt,
    DraftOpt,
    DraftStopOpt,
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
    check_draft_stop,
    cli_errors,
    draft_spec,
    lookup_memory_for,
    resolve_models,
)
from .display import err_console, live_line, print_error, summary
from .render import Render

PROMPT, MORE = ">>> ", "... "
# a line starting with it opens a message of several lines, and one ending with it closes it
FENCE = '"""'
HELP = """\
/clear        start a new conversation (the system prompt stays)
/stats        the last reply's statistics: prompt tokens processed and cached, speculation
/system TEXT  set the system prompt for the turns to come (/system alone: none)
/save FILE    write the conversation as a JSON list of messages
/help         this list
/bye          leave (Ctrl-D too)
\"\"\"           begin and end a message of several lines
Ctrl-C stops a reply (what was shown stays in the conversation)."""


@cli_errors
def chat(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    lookup: LookupOpt = False,
    lookup_memory: LookupMemoryOpt = None,
    k: KOpt = None,
    max_tokens: MaxTokensOpt = 512,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    verify: VerifyOpt = None,
    draft_stop: DraftStopOpt = False,
    tree: TreeOpt = None,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    system: str = typer.Option(None, "--system", help="A system prompt (/system changes it)."),
    quiet: QuietOpt = False,
    show_draft: ShowDraftOpt = False,
    context: ContextOpt = None,
    server: ServerOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Chat with the model: a prompt loop, each reply streamed (/help lists the commands)."""
    from ..core.acceptance import sampled_rule
    from ..core.sampling import SamplingParams
    from ..decoding.session import Request

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
    request = Request(
        sampling=params, max_tokens=max_tokens, seed=seed, stop=stop or [],
        verify=verify or DEFAULT_VERIFY, draft_stop=draft_stop,
    )  # fmt: skip
    if server:
        local = target or context or lookup or draft_stop or trees is not None
        local = local or lookup_memory is not None
        if local or draft not in (None, "none", "lookup"):
            raise BadInput(
                "with --server the server's models run: drop --target, --context, --lookup, "
                "--lookup-memory, --draft-stop, --tree and --draft ALIAS (--draft none or "
                "lookup still choose how it drafts)"
            )
        backend: _Backend = _remote(server, api_key, request, draft, kk, verify, system)
    else:
        backend = _local(request, system, target, draft, lookup, lookup_memory, kk,
                         trees, context, quiet)  # fmt: skip
    _loop(backend, Shown(quiet, show_draft))


def _note(message: str) -> None:
    """One line on stderr about the conversation (turns dropped to fit the context)."""
    err_console().print(message, style="yellow", markup=False, soft_wrap=True)


def _remote(url, api_key, request, draft, k, verify, system) -> _RemoteChat:
    """A running server's models, asked for their name first (so one that cannot be reached
    ends the command before its first prompt)."""
    from ..serving.client import Remote, RemoteChat, model_name, request_body

    remote = Remote(url, api_key)
    num_draft = k.value if k is not None else None
    chat = RemoteChat(remote, request_body(request, draft, num_draft, verify), system, _note)
    chat.names["model"] = model_name(remote)
    return _RemoteChat(chat, str(num_draft) if num_draft is not None else "server's")


@dataclass
class Shown:
    """How replies are shown: quiet (no stats line after each), show_draft (colour the
    draft-accepted text on a terminal)."""

    quiet: bool = False
    show_draft: bool = False


class _Backend:
    """Where replies come from: the pair here (_LocalChat) or a server (_RemoteChat).

    ``start`` begins the reply to a user message: (its text events, the stats they fill);
    ``done`` records what was shown of it; ``conversation`` holds the messages. name,
    drafter, k_label, where: as the summary and the stats line show them."""

    name = drafter = k_label = "?"
    where: dict

    def start(self, text: str) -> tuple[Iterator, Stats]:
        raise NotImplementedError

    def done(self, reply: str | None) -> None:
        """Record ``reply`` (what was shown); None: it failed before anything was shown."""
        raise NotImplementedError

    def clear(self) -> None:
        """A new conversation; the system prompt stays."""
        self.conversation.clear()


class _LocalChat(_Backend):
    """The pair loaded here: a conversation.Chat and the request each reply runs under;
    say: told of the turns dropped to fit the context."""

    def __init__(self, chat, request, name: str, drafter: str, k_label: str, load_s: float,
                 say: Callable[[str], None]):  # fmt: skip
        self.chat, self.request, self.gen, self.say = chat, request, None, say
        self.conversation = chat.conversation
        self.name, self.drafter, self.k_label = name, drafter, k_label
        self.where = {"load_s": load_s}

    def start(self, text: str) -> tuple[Iterator, Stats]:
        turn = self.chat.ask(text, self.request)
        self.gen = turn.generation
        if turn.dropped:
            self.say(
                f"dropped the oldest {_turns(turn.dropped)} to fit the context of "
                f"{self.chat.limit} tokens (the system prompt stays)"
            )
        return self.gen.text(), self.gen.stats

    def done(self, reply: str | None) -> None:
        if reply is None:
            self.chat.failed()
            return
        self.chat.answered(reply)
        self.gen.finish()  # (what adaptive k learned, saved)

    def clear(self) -> None:
        self.chat.clear()


class _RemoteChat(_Backend):
    """A running `specmlx serve` (client.RemoteChat): the server's prompt cache keeps the
    turns before. k_label: -k as given ("server's" where not)."""

    def __init__(self, chat, k_label: str) -> None:
        self.chat, self.k_label = chat, k_label
        self.conversation = chat.conversation
        self.where = {"server": chat.remote.url}

    @property
    def name(self) -> str:
        return f"{self.chat.names['model']} (served by {self.chat.remote.url})"

    @property
    def drafter(self) -> str:
        return self.chat.names["drafter"]

    def start(self, text: str) -> tuple[Iterator, Stats]:
        stats = Stats()
        return self.chat.reply(text, stats), stats

    def done(self, reply: str | None) -> None:
        if reply is None:
            self.chat.failed()
        else:
            self.chat.answered(reply)


def _turns(n: int) -> str:
    return f"{n} turn{'s' * (n != 1)}"


def _local(request, system, target, draft, lookup, lookup_memory, k, tree, context, quiet):
    """The pair loaded here, as the command line names it, ready to chat."""
    from ..decoding.conversation import Chat, require_chat_template
    from ..decoding.session import Pair, Session
    from ..drafting.choosing.choosers import ChooserStore
    from ..drafting.lookup.memory import LookupMemory
    from ..models.loading import load_pair
    from ..models.registry import load_registry
    from .display import print_warning

    registry = load_registry()
    models = resolve_models(registry, target, draft, lookup, k, tree)
    keep = lookup_memory_for(models, lookup_memory)
    check_draft_stop(models, request.draft_stop)
    console = err_console()
    say = None if quiet else (lambda m: console.print(m, style="dim", soft_wrap=True, markup=False))
    tspec = registry.resolve(models.target)
    limit = context or registry.context_for(tspec, draft_spec(registry, models))
    # a chat can reach its whole context: memory is planned for all of it
    tgt, drf, shared = load_pair(
        models.target, models.draft, registry=registry, context=limit, progress=say,
        lone=not request.draft_stop,
    )  # fmt: skip
    require_chat_template(tgt.tokenizer, tgt.spec.alias)
    memory = None
    if keep:
        directory = LookupMemory.directory_for(tgt.tokenizer)
        memory = LookupMemory(directory, vocab_size=tgt.vocab_size, warn=print_warning)
    store = ChooserStore(warn=print_warning)  # adaptive k resumes from this pair's last run
    session = Session(Pair.of(tgt, drf, shared), choosers=store, memory=memory)
    request = replace(request, k=models.k, drafter=models.drafter, tree=models.tree)
    parts = ([drf.spec.alias] if drf else []) + ([str(models.lookup)] if models.lookup else [])
    drafter = " + ".join(parts) or "none"
    chat = Chat(session, limit, system)
    return _LocalChat(
        chat, request, tgt.spec.alias, drafter, str(models.k), tgt.load_seconds, _note
    )


def read_message(read: Callable[[str], str]) -> str:
    """One message from ``read`` (input(), given the prompt to show): a line, or the lines
    from one starting with three double quotes to one ending with them (the quotes dropped),
    as mlx_lm.chat and ollama take a message of several lines. EOFError and
    KeyboardInterrupt come through."""
    line = read(PROMPT)
    start = line.lstrip()
    if not start.startswith(FENCE):
        return line
    first = start[len(FENCE) :]
    if first.rstrip().endswith(FENCE):  # """one line"""
        return first.rstrip()[: -len(FENCE)]
    lines = [first]
    while True:
        line = read(MORE)
        if line.rstrip().endswith(FENCE):
            lines.append(line.rstrip()[: -len(FENCE)])
            break
        lines.append(line)
    return "\n".join(lines).strip("\n")


def _history() -> Callable[[], None]:
    """Line editing and history, from readline where Python has it: the history file is
    $SPECMLX_HOME/chat_history. Returns what saves it at the end (best-effort: a read-only
    home keeps none)."""
    try:
        import readline
    except ImportError:  # (Windows, or a Python built without it: plain input())
        return lambda: None
    path = specmlx_home() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass  # none yet, or unreadable: this session starts without
    readline.set_history_length(1000)

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass

    return save


class _Stop:
    """Ctrl-C while a reply is generated: the first stops it at the next piece (the caches
    stay exact, so the next turn still reuses them), a second at once (KeyboardInterrupt,
    which may leave the caches to be prefilled again)."""

    def __init__(self) -> None:
        self.asked = False
        self._old = None

    def __enter__(self) -> _Stop:
        self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._old)

    def _handle(self, signum, frame) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True

    def until_asked(self, events: Iterator) -> Iterator:
        """``events`` until Ctrl-C; closing them then (the engine settles its caches)."""
        try:
            for ev in events:
                yield ev
                if self.asked:
                    return
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()


def _loop(backend: _Backend, shown: Shown) -> None:
    """Read messages and commands until Ctrl-D or /bye."""
    console = err_console()
    save_history = _history()
    last: Stats | None = None
    console.print(f"chatting with {backend.name}: /help for commands, Ctrl-D or /bye to leave",
                  style="dim", markup=False)  # fmt: skip
    try:
        while True:
            try:
                text = read_message(input)
            except KeyboardInterrupt:  # a fresh prompt, as Python's own does
                sys.stdout.write("\n")
                continue
            except EOFError:
                sys.stdout.write("\n")
                return
            if not text.strip():
                continue
            if text.startswith("/"):
                if _command(text, backend, last, console) == "bye":
                    return
                continue
            last = _reply(backend, text, shown, console) or last
    finally:
        save_history()


def _command(text: str, backend: _Backend, last: Stats | None, console) -> str:
    """Run a /command; "bye" when the chat ends."""
    name, _, arg = text.partition(" ")
    arg = arg.strip()
    if name == "/bye":
        return "bye"
    if name == "/help":
        console.print(HELP, markup=False, highlight=False)
    elif name == "/clear":
        backend.clear()
        console.print("a new conversation", style="dim")
    elif name == "/system":
        backend.conversation.system = arg or None
        said = f"system prompt set ({len(arg)} characters)" if arg else "no system prompt"
        console.print(said, style="dim")
    elif name == "/save":
        if not arg:
            print_error("/save needs a file: /save FILE")
        else:
            try:
                backend.conversation.save(Path(arg).expanduser())
                n = len(backend.conversation.messages())
                console.print(f"saved {n} messages to {arg}", style="dim", markup=False)
            except OSError as e:
                print_error(f"cannot write {arg}: {e.strerror or e}")
    elif name == "/stats":
        if last is None:
            console.print("no reply yet", style="dim")
        else:
            console.print(
                summary(last, target=backend.name, draft=backend.drafter, **backend.where)
            )
            console.print(_prompt_line(last), markup=False, highlight=False)
    else:
        console.print(f"unknown command {name}: /help lists them", style="yellow", markup=False)
    return ""


def _prompt_line(stats: Stats) -> str:
    """The turn-to-turn cache in one line: what the last prompt prefilled against what it
    took from the turns before."""
    fed = stats.prompt_tokens - stats.cached_tokens
    return (
        f"prompt tokens: {stats.prompt_tokens}, processed {fed}, cached {stats.cached_tokens} "
        "(kept from earlier turns)"
    )


def _reply(backend: _Backend, text: str, shown: Shown, console) -> Stats | None:
    """Stream the reply to ``text``; its statistics, or None where it was refused."""
    try:
        events, stats = backend.start(text)
    except SpecmlxError as e:  # too long for the context: the session goes on
        print_error(str(e))
        return None
    render = Render(console, False, shown.quiet, shown.show_draft, backend.k_label)
    with _Stop() as stop:
        pieces = stop.until_asked(events)
        try:
            interrupted = render.stream(pieces, stats) or stop.asked
        except SpecmlxError as e:  # the server failed or refused mid-way
            backend.done(render.text or None)
            print_error(str(e))
            return None
        finally:
            pieces.close()  # (a second Ctrl-C may leave it open: the engine settles here)
    if render.text and not render.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    backend.done(render.text)
    if interrupted:
        console.print("(stopped)", style="yellow")
    if not shown.quiet:
        console.print(live_line(stats, backend.k_label), style="dim")
    return stats
