"""What the commands share: option types, the error wrapper, resolving which models run,
and the checks every command makes the same way."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperCommand

from ..decoding.session import DrafterChoice
from ..distributed.launch import rank_prefix
from ..drafting.choosing.choosers import AUTO, K
from ..drafting.choosing.tree_size import AUTO as TREE_AUTO
from ..drafting.choosing.tree_size import TREE_MAX, TreeSize
from ..drafting.lookup.kinds import SUFFIX, LookupKind
from ..drafting.self_draft import is_self
from ..errors import BadInput, SpecmlxError
from ..models.registry import head_of
from .display import err_console, print_error

# options that run, serve and bench share (each command keeps its own default and wording
# where they differ)
TargetOpt = Annotated[
    str | None, typer.Option("--target", "-t", help="Target alias, path or hf repo.")
]
DraftOpt = Annotated[
    str | None,
    typer.Option(
        "--draft",
        "-d",
        help="Draft alias/path, 'lookup' (prompt lookup: suffix trees; 'lookup:ngram' the "
        "latest match's continuation), 'lookahead' or 'lookahead:w=W,n=N,g=G' (Jacobi "
        "guesses in the same pass), 'mtp' (the target's own MTP head), "
        "'eagle3:PATH' (an EAGLE-3 head), 'dflash:PATH' (a DFlash block drafter), "
        "'medusa:PATH' (Medusa heads), 'self', "
        "'self:exit=E' or 'self:skip=LIST' (the target's own layers), or 'none'.",
    ),
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
TreeOpt = Annotated[
    str | None,
    typer.Option(
        "--tree",
        help="Token trees: 'off' (chains), 'auto' (the default: side leaves where the cost "
        f"model says they pay), N (1-{TREE_MAX}: the most drafted tokens a pass verifies) or "
        "expand:N (a draft model or chained head grows a tree of N, EAGLE-2's).",
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
LookupOpt = Annotated[bool, typer.Option("--lookup", help="Prompt lookup first, then the draft.")]
LookupMemoryOpt = Annotated[
    bool | None,
    typer.Option(
        "--lookup-memory/--no-lookup-memory",
        help="With lookup: also look up (and keep) recent outputs, per tokenizer under "
        "$SPECMLX_HOME/lookup (default: on).",
    ),
]
KOpt = Annotated[
    str | None, typer.Option("-k", "--num-draft", help="Draft tokens per round, or 'auto'.")
]
MaxTokensOpt = Annotated[int, typer.Option("-n", "--max-tokens", help="Tokens to generate.")]
SeedOpt = Annotated[
    int | None, typer.Option("--seed", help="Random seed for reproducible sampling.")
]
StopOpt = Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No live line or summary.")]
ShowDraftOpt = Annotated[bool, typer.Option("--show-draft", help="Colour draft-accepted text.")]
ServerOpt = Annotated[
    str | None,
    typer.Option("--server", envvar="SPECMLX_SERVER", help="Send it to a running `specmlx serve`."),
]
ApiKeyOpt = Annotated[
    str | None,
    typer.Option("--api-key", envvar="SPECMLX_API_KEY", help="The server's API key."),
]


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


@dataclass
class Models:
    """Which models a command loads and the drafting it defaults to, resolved against
    models.toml before anything loads: target alias, draft alias (or None: none loaded),
    lookup (prompt lookup drafts too, and how: a kinds.LookupKind; None: no lookup), k (the
    pair's default when none was given), tree."""

    target: str
    draft: str | None
    lookup: LookupKind | None
    k: K
    tree: TreeSize = TREE_AUTO

    @property
    def drafter(self) -> DrafterChoice:
        """What drafts, as a session.Request takes it."""
        return DrafterChoice(self.draft is not None, self.lookup)


def resolve_models(
    registry, target: str | None, draft: str | None, lookup: bool, k: K | None,
    tree: TreeSize | None = None,
):  # fmt: skip
    """Fill in what the user did not say from the pairs and defaults in models.toml.

    registry: models.toml's; target, draft: as given (None: the pair's or the default; a
    lookup form, "lookup:ngram" or "lookahead:..." say how lookup proposes, alone); lookup:
    --lookup (suffix lookup first, then the draft); k, tree: as parsed from the command line
    (None: the pair's or the default)."""
    import mlx.core as mx

    pair = None
    if target is None:
        pair = registry.default_pair(cpu=mx.default_device() == mx.cpu)
        target = pair.target
    else:
        pair = next((p for p in registry.pairs.values() if p.target == target), None)
    if draft is None:
        draft = pair.draft if pair else "none"
    kind = SUFFIX if lookup else None
    if draft in ("lookup", "lookahead") or draft.startswith(("lookup:", "lookahead:")):
        try:
            draft, kind = "none", LookupKind.of(draft)
        except BadInput as e:
            raise BadInput(f"--draft {draft}: {e}") from None
    k = k if k is not None else (pair.k if pair else AUTO)
    tree = tree if tree is not None else (pair.tree if pair else TREE_AUTO)
    return Models(target, None if draft == "none" else draft, kind, k, tree)


HostsOpt = Annotated[
    str | None,
    typer.Option(
        "--hosts", help="Split the target over ranks: IPs, comma separated (localhost for local)."
    ),
]
HostfileOpt = Annotated[
    Path | None, typer.Option("--hostfile", help="Split the target over MLX's hostfile's hosts.")
]


def draft_spec(registry, models):
    """The draft model's spec (None: no draft model, or a head over the target's hidden
    states: its MTP head, an EAGLE-3 head)."""
    if models.draft is None or head_of(models.draft) or is_self(models.draft):
        return None  # (self-drafting: the target's own layers)
    return registry.resolve(models.draft)


def lookup_memory_for(models, lookup_memory: bool | None) -> bool:
    """Whether this run keeps lookup memory: on by default where it looks up (models.lookup);
    lookup_memory: --lookup-memory/--no-lookup-memory as given (None: not given), BadInput where
    nothing looks up, so a flag that would do nothing is not silently dropped."""
    if lookup_memory is not None and models.lookup is None:
        raise BadInput(
            "--lookup-memory/--no-lookup-memory apply only with lookup: --draft lookup, "
            "lookup:ngram or lookahead, or --lookup"
        )
    return models.lookup is not None and lookup_memory is not False


def check_draft_stop(models, draft_stop: bool, ranks: bool = False) -> None:
    """--draft-stop stops a draft model's drafting by the adaptive chooser's cost model
    (ranks: the target is split over ranks, where the chooser is rank 0's)."""
    if draft_stop and ranks:
        # each chunk's go would be rank 0's timing, one more collective per chunk
        raise BadInput("--draft-stop does not run over ranks (--hosts/--hostfile)")
    if draft_stop and not (models.draft and models.k.auto):
        raise BadInput("--draft-stop needs a draft model and -k auto")
    if draft_stop and head_of(models.draft):
        raise BadInput(
            "--draft-stop needs a draft model: a head (MTP, EAGLE-3, DFlash) drafts the chooser's k"
        )


def rank_timeout() -> float:
    """Seconds a rank waits for the others before giving up ($SPECMLX_RANK_TIMEOUT, 300)."""
    try:
        return float(os.environ.get("SPECMLX_RANK_TIMEOUT") or 300)
    except ValueError:
        raise BadInput("SPECMLX_RANK_TIMEOUT must be a number of seconds") from None


def check_context(prompt_tokens: int, max_tokens: int, limit: int, name: str) -> None:
    """BadInput, with the numbers, when the prompt plus max_tokens exceed the context."""
    if prompt_tokens + max_tokens > limit:
        raise BadInput(
            f"the prompt has {prompt_tokens} tokens and --max-tokens asks for {max_tokens} "
            f"more: {prompt_tokens + max_tokens} > the context of {limit} ({name}); shorten "
            "the prompt, lower --max-tokens or raise --context"
        )
