"""How `specmlx run` shows a generation: text on stdout, a live line and a summary on stderr,
or one JSON object."""

from __future__ import annotations

import json
import os
import sys

import typer
from rich.console import Console
from rich.live import Live

from .display import live_line, summary


class Render:
    """Streams text to stdout and a live line to stderr; collects text and ids for --json.

    console: stderr's rich console; as_json: one JSON object on stdout instead of text;
    quiet: no live line or summary; show_draft: colour draft-accepted text on a terminal;
    k_label: k as shown on the live line."""

    def __init__(
        self, console: Console, as_json: bool, quiet: bool, show_draft: bool, k_label: str
    ) -> None:
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

    def json(
        self, stats, target, draft_name, k, request, verify: str = "", ranks: dict | None = None
    ):
        """The --json object on stdout (nothing without --json): ``request`` is the run's
        session.Request; verify: the rule shown ("": the request's); ``ranks`` when
        distributed."""
        if not self.as_json:
            return
        out = {
            "text": self.text,
            "tokens": self.tokens,
            "stats": stats.as_dict(),
            "target": target,
            "draft": draft_name,
            "k": k,
            "temperature": request.sampling.temperature,
            "seed": request.seed,
            "verify": verify or request.verify,
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
