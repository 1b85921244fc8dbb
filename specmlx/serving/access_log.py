"""One access log line per request: its method and route, status, prompt, cached and generated
tokens, time, and for an error (4xx, 5xx, or an error event that ended a stream) its message.

The lines go to Python's logging ("specmlx.serve.access", at INFO), never straight to a
stream: `specmlx serve` installs the handler (``install``: text or one JSON object a line,
on stderr, where its other messages go); an app made by create_app without it logs nowhere
until its caller configures logging.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field

ACCESS = "specmlx.serve.access"
SERVER = "specmlx.serve"  # the server's own logger, the access log's parent
_KEY = "specmlx_access"  # where a request's record waits in its ASGI scope's state
_BODY_KEPT = 4096  # bytes of an error answer read for its message


@dataclass
class _Record:
    """What one request's line says, filled in as it is answered."""

    method: str
    route: str
    start: float
    status: int | None = None
    jobs: list = field(default_factory=list)  # the worker's jobs (n_cmpl > 1: several)
    error: str | None = None
    body: bytes = b""  # the start of an error answer, for its message


def note_job(request, job) -> None:
    """Count ``job``'s tokens in ``request``'s line (its Stats are read when the line is
    written, so a stream's are whole).

    request: the Starlette request; job: the worker's Job."""
    record = request.scope.get("state", {}).get(_KEY)
    if record is not None:
        record.jobs.append(job)


def note_error(request, message: str) -> None:
    """An error that ended ``request``'s stream after its 200 went out: its line says it.

    request: the Starlette request (None: nothing noted); message: the error's message."""
    record = None if request is None else request.scope.get("state", {}).get(_KEY)
    if record is not None:
        record.error = message


class AccessLog:
    """ASGI middleware: one line per HTTP request, written once its answer has gone out (a
    stream's at its end), or when it ended without one (status 499: the client left)."""

    def __init__(self, app):
        self.app = app
        self.log = logging.getLogger(ACCESS)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        record = _Record(scope.get("method", ""), scope.get("path", ""), time.monotonic())
        scope.setdefault("state", {})[_KEY] = record
        written = False

        async def sending(message):
            nonlocal written
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body":
                if (record.status or 0) >= 400 and len(record.body) < _BODY_KEPT:
                    record.body += message.get("body", b"")[:_BODY_KEPT]
                if not message.get("more_body", False) and not written:
                    written = True
                    self._write(record)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            record.status = record.status or 500
            raise
        finally:
            if not written:
                record.status = record.status or 499
                self._write(record)

    def _write(self, record: _Record) -> None:
        fields = _fields(record)
        self.log.info(_text(fields), extra={"access": fields})


def _fields(record: _Record) -> dict:
    """The line's fields, as the JSON format writes them."""
    stats = [job.stats for job in record.jobs]
    error = record.error
    if error is None and (record.status or 0) >= 400:
        error = _message(record.body)
    return {
        "method": record.method,
        "route": record.route,
        "status": record.status,
        "time_s": round(time.monotonic() - record.start, 4),
        "prompt_tokens": sum(s.prompt_tokens for s in stats) if stats else None,
        "cached_tokens": sum(s.cached_tokens for s in stats) if stats else None,
        "generated_tokens": sum(s.generated for s in stats) if stats else None,
        "error": error,
    }


def _message(body: bytes) -> str:
    """The message of an error answer: OpenAI's {"error": {"message"}}, else its text."""
    text = body.decode("utf-8", "replace")
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    return " ".join(str(message).split())[:500]  # one line, whatever the answer held


def _text(f: dict) -> str:
    """The terse line: "POST /infill 200 0.412s prompt=1234 cached=1200 generated=16"."""
    line = f"{f['method']} {f['route']} {f['status']} {f['time_s']:.3f}s"
    if f["prompt_tokens"] is not None:
        line += (
            f" prompt={f['prompt_tokens']} cached={f['cached_tokens']}"
            f" generated={f['generated_tokens']}"
        )
    if f["error"]:
        line += f" error: {f['error']}"
    return line


class JsonLines(logging.Formatter):
    """One JSON object a line: an access line's fields, or any other record's level and
    message; each with its time ("ts", seconds since the epoch)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "access", None)
        if fields is None:
            fields = {"level": record.levelname.lower(), "message": record.getMessage()}
        return json.dumps({"ts": round(record.created, 3), **fields})


class _Text(logging.Formatter):
    """The time of day, then the message."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.getMessage()}"


class _Stderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is when a line is written: one installed by an
    earlier command in the same process (a test's CLI runner swaps stderr and closes its
    own) never writes to a stream closed since."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass  # (always the current stderr)


def install(form: str = "text", access: bool = True, stream=None) -> logging.Logger:
    """Send the server's log (its access lines among them) to ``stream`` as ``form``.

    form: "text" (the time of day and a terse line) or "json" (one object a line); access:
    whether each request gets a line; stream: where to (None: stderr, as it is at each
    line).
    Returns the server's logger, for the CLI's own lines."""
    handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    handler.setFormatter(JsonLines() if form == "json" else _Text())
    log = logging.getLogger(SERVER)
    for old in list(log.handlers):  # (installed twice in one process: one handler)
        log.removeHandler(old)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    logging.getLogger(ACCESS).setLevel(logging.INFO if access else logging.WARNING)
    return log
