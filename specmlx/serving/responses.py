"""The server's answers to a job: the worker's events delivered into the event loop
(``Events``), then OpenAI's response or chunks (``respond``) or llama.cpp's (``respond_llama``).
A client that hangs up cancels its job, which frees its slot; a job that fails before its
first token gets its real status, not a 200 carrying an error event."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..core.stats import Stats, TokenEvent
from ..decoding import session
from . import api_shapes as shapes
from .access_log import note_error, note_job
from .api_errors import ApiError, as_api_error, error_body
from .api_schemas import LlamaBody, SamplingBody
from .worker import QueueFull, ShuttingDown, Worker


class Events:
    """The worker's events for one job, delivered into this event loop."""

    def __init__(
        self,
        worker: Worker,
        gen: session.Request,
        request: Request | None = None,
        editor: bool = False,
    ):
        loop = asyncio.get_running_loop()
        self.request = request
        self.queue: asyncio.Queue = asyncio.Queue()

        def emit(kind: str, value: object) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))

        try:
            self.job = worker.submit(gen, emit, editor)
        except QueueFull as e:
            raise ApiError(503, str(e), "server_error", "overloaded") from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), "server_error", "shutting_down") from None
        if request is not None:  # its figures go into the request's access log line
            note_job(request, self.job)

        self.checked = time.monotonic()
        self.held: tuple | None = None

    async def started(self, request: Request) -> None:
        """Wait for the job's first event before a stream's headers go out: a request that
        fails before its first token (refused while queued at shutdown, say) gets its real
        status instead of a 200 carrying an error event. ClientGone if the client left."""
        self.held = await self.next(request)
        if self.held[0] == "error":
            raise as_api_error(self.held[1])

    async def next(self, request: Request | None = None):
        """The next event. With ``request`` (a response not streamed yet), a client that hung
        up cancels the job (looked at every quarter second) and raises ClientGone."""
        if self.held is not None:
            held, self.held = self.held, None
            return held
        while True:
            if request is not None and time.monotonic() - self.checked > 0.25:
                self.checked = time.monotonic()
                if await request.is_disconnected():
                    self.job.cancel()
                    raise ClientGone
            try:
                return await asyncio.wait_for(self.queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                continue


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def respond(
    request: Request,
    worker: Worker,
    gen: session.Request,
    body: SamplingBody,
    kind: str,
    settings,
):
    """OpenAI's answer to a completion or chat completion: whole, or streamed as chunks."""
    events = Events(worker, gen, request)
    rid = f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    base = {"id": rid, "created": int(time.time()), "model": settings.model_name}
    chat = kind == "chat.completion"
    if body.stream:
        usage = bool((body.stream_options or {}).get("include_usage"))
        try:
            await events.started(request)
        except ClientGone:
            return Response(status_code=499)
        stream = _stream(events, base, chat, usage, body.return_tokens)
        return StreamingResponse(stream, media_type="text/event-stream")
    text, tokens = [], []
    try:
        while True:
            what, value = await events.next(request)
            if what == "piece":
                text.append(value.text)
                tokens += [value.token] if value.token is not None else []
            elif what == "error":
                raise as_api_error(value)
            else:
                stats = value
                break
    except ClientGone:
        return Response(status_code=499)  # nobody reads this
    shown = tokens if body.return_tokens else None
    return shapes.completion(base, chat, "".join(text), stats, events.job, shown)


async def _stream(events: Events, base: dict, chat: bool, usage: bool, with_tokens: bool):
    """OpenAI's chunks as server-sent events, ending with data: [DONE]. If the client goes
    away, Starlette cancels this generator and the job is cancelled with it."""
    sse = shapes.sse
    try:
        if chat:
            yield sse(shapes.role_chunk(base))
        while True:
            what, value = await events.next()
            if what == "piece":
                piece: TokenEvent = value
                if piece.text or (with_tokens and piece.token is not None):
                    shown = piece if with_tokens else None
                    yield sse(shapes.chunk(base, chat, piece.text, None, shown))
            elif what == "error":
                err = as_api_error(value)
                note_error(events.request, err.message)
                yield sse(error_body(err.message, err.kind, err.code))
                break
            else:
                stats: Stats = value
                last = shapes.chunk(base, chat, None if chat else "", stats.finish_reason or "stop")
                last["specmlx"] = shapes.job_stats(stats, events.job)
                yield sse(last)
                if usage:
                    yield sse(shapes.usage_chunk(base, chat, stats))
                break
        yield sse("[DONE]")
    finally:
        events.job.cancel()  # no-op when it finished; frees the slot when the client left


async def respond_llama(
    request,
    worker,
    gen: session.Request,
    body: LlamaBody,
    settings,
    truncated: bool = False,
    editor: bool = False,
):
    """llama.cpp's response (or, for n_cmpl > 1, a list of them: each completion a seed
    further, so sampled ones differ; greedy ones are the same); ``truncated``: the prompt
    was cut to fit the context; ``editor``: an editor's request (/infill: worker.Job)."""
    shown = _generation_settings(settings, 0 if gen.warm_up else gen.max_tokens)
    fields = body.response_fields
    if body.n_cmpl == 1:
        return await _respond_infill(
            request, worker, gen, body.stream, fields, shown, truncated, editor
        )
    if body.stream:
        raise ApiError(400, "n_cmpl > 1 cannot stream", code="unsupported")
    seed = gen.seed if gen.seed is not None else random.getrandbits(63)
    out = []
    for i in range(body.n_cmpl):
        one = replace(gen, seed=(seed + i) % 2**64)
        got = await _respond_infill(request, worker, one, False, fields, shown, truncated, editor)
        if isinstance(got, Response):  # the client left
            return got
        out.append(got)
    return out


def _generation_settings(settings, max_tokens: int) -> dict:
    return shapes.generation_settings(settings.model_name, settings.context, max_tokens)


async def _respond_infill(
    request: Request,
    worker: Worker,
    gen: session.Request,
    stream: bool,
    fields: list[str] | None = None,
    generation_settings: dict | None = None,
    truncated: bool = False,
    editor: bool = False,
):
    """llama.cpp's /completion response shape: content, stop, tokens, timings (just
    ``fields`` when given); ``truncated``: the prompt was cut to fit the context."""
    events = Events(worker, gen, request, editor)

    def final(content: str, stats: Stats) -> dict:
        out = shapes.llama_completion(content, stats, events.job, generation_settings, truncated)
        return out if fields is None else shapes.pick_fields(out, fields)

    if stream:

        async def chunks() -> AsyncIterator[str]:
            try:
                while True:
                    what, value = await events.next()
                    if what == "piece" and value.text:
                        yield shapes.sse({"content": value.text, "stop": False})
                    elif what == "error":
                        err = as_api_error(value)
                        note_error(request, err.message)
                        yield shapes.sse(error_body(err.message, err.kind, err.code))
                        return
                    elif what == "done":
                        yield shapes.sse(final("", value))
                        return
            finally:
                events.job.cancel()

        try:
            await events.started(request)
        except ClientGone:
            return Response(status_code=499)
        return StreamingResponse(chunks(), media_type="text/event-stream")
    text = []
    try:
        while True:
            what, value = await events.next(request)
            if what == "piece":
                text.append(value.text)
            elif what == "error":
                raise as_api_error(value)
            else:
                return final("".join(text), value)
    except ClientGone:
        return Response(status_code=499)
