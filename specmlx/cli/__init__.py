"""The specmlx command line: parse, call the library, render with rich. What a command was
asked for goes to stdout (run's text or --json, listings, bench's tables, what pull, build
and distill made, --version), so it pipes; loading, progress, a server's log lines, warnings
and errors go to stderr. One module per command (run, chat, serve, bench, models, distill);
this one builds the typer app from them.

Commands import what only they need (loading, the engine, the server, the bench) when they
run, so `--help`, `--version` and bad-usage errors answer without loading models, building
the server or probing anything.
"""

from __future__ import annotations

import sys

import typer

from .. import __version__
from ..machine import version
from . import bench, chat, distill, models, run, serve
from .common import PromptCommand

app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Lossless speculative decoding on MLX: a draft proposes, the target verifies.",
)
models_app = typer.Typer(
    help="List, fetch, build and remove the models in models.toml.", no_args_is_help=True
)
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


app.command("run", cls=PromptCommand)(run.run)
app.command("chat")(chat.chat)
app.command("serve")(serve.serve)
app.command("distill")(distill.distill)
app.command("bench")(bench.bench)
models_app.command("list")(models.models_list)
models_app.command("pull")(models.models_pull)
models_app.command("rm")(models.models_rm)
models_app.command("build")(models.models_build)


def run_app() -> None:
    """Run the app; then, if the command used MLX, destroy this thread's MLX streams while
    the interpreter is still whole (MLX asks this of every thread that used it: its own
    cleanup at exit comes too late and can abort a finished command with signal 6)."""
    try:
        app(prog_name="specmlx")
    finally:
        mlx = sys.modules.get("mlx.core")  # (not imported here: --help never loads MLX)
        if mlx is not None:
            mlx.clear_streams()
