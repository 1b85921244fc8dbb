"""`specmlx serve`: an OpenAI-compatible HTTP server over one loaded pair.

FastAPI validates requests, which are tokenized here and handed to the worker thread (the
only thread that runs MLX); text streams back as server-sent events in OpenAI's chunk format.
Endpoints: /health, /v1/models, /v1/completions (with `suffix` for fill-in-the-middle),
/v1/chat/completions, llama.cpp's /infill (editor plugins), and /metrics (Prometheus).
Every error is OpenAI's {"error": {"message", "type", "code"}} with a 4xx status for bad
input, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import random
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from .acceptance import DEFAULT_VERIFY, sampled_rule
from .distributed import RankFailure
from .errors import BadInput, SpecmlxError
from .fim import encode_infill, require_fim
from .sampling import SamplingParams
from .stats import Stats, TokenEvent
from .stream import encode_prompt
from .worker import GenRequest, Job, QueueFull, ShuttingDown, Worker

MAX_STOPS = 4  # as OpenAI allows
MAX_COMPLETIONS = 8  # llama.cpp's n_cmpl, generated one after another
BODY_TIMEOUT_S = 30.0  # the longest wait for the next piece of a request body (then a 408)
MAX_CONNECTIONS = 64  # open connections uvicorn serves at once (then a 503): slow clients
# that never finish their headers hold one each, and uvicorn has no header timeout


class ApiError(Exception):
    """An error with an HTTP status, in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------- request bodies

Positive = Annotated[int, Field(gt=0)]


# llama.cpp's clients send -1 for "random"; anything else must fit the 64-bit seed MLX takes
Seed = Annotated[int, Field(ge=-1, le=2**64 - 1)]


def _no_lone_surrogates(value: Any, where: str = "body") -> None:
    """Refuse text that is not valid Unicode (a lone UTF-16 surrogate such as "\\ud800",
    which JSON can carry and no tokenizer can encode), wherever it sits in a request."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} holds a lone surrogate at character {e.start}") from None
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            _no_lone_surrogates(getattr(value, name), name)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _no_lone_surrogates(item, where)
    elif isinstance(value, dict):
        for item in value.values():
            _no_lone_surrogates(item, where)


class _Text(BaseModel):
    """A request body whose every string must be valid Unicode (else a 400)."""

    @model_validator(mode="after")
    def _valid_text(self):
        _no_lone_surrogates(self)
        return self


class _Sampling(_Text):
    """The fields every generating endpoint shares (unknown fields are ignored, as clients
    send many; fields that would change the output and are not supported are refused)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None  # -1 or None: random
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # specmlx extensions
    draft: Literal["model", "lookup", "none"] | None = None
    num_draft: Annotated[int, Field(ge=0)] | Literal["auto"] | None = None
    verify: str | None = None  # "block" or "token" (checked where the engine checks it)
    return_tokens: bool = False  # token ids in each chunk (specmlx run --server uses it)

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, "n must be 1: one completion per request", code="unsupported")
        if self.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", code="unsupported")
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            raise ApiError(
                400,
                "presence/frequency penalties and logit_bias are not supported: they would "
                "change the target's distribution",
                code="unsupported",
            )

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        return [s for s in stops if s]


class CompletionBody(_Sampling):
    prompt: str
    suffix: str | None = None
    echo: bool = False
    best_of: int | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text", "") for p in self.content if p.get("type") == "text"]
            if len(parts) != len(self.content):
                raise ApiError(400, "only text message content is supported")
            return "".join(parts)
        return self.content or ""


class ChatBody(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Positive | None = None


class ExtraChunk(BaseModel):
    model_config = ConfigDict(extra="ignore")
    filename: str = ""
    text: str = ""


class _LlamaBody(_Text):
    """The fields llama.cpp's /completion and /infill share (other fields ignored)."""

    model_config = ConfigDict(extra="ignore")

    n_predict: int = -1  # < 0: the server's default; 0: a warm-up, prefill only
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    stop: list[str] = []
    seed: Seed = -1  # -1: random
    stream: bool = False
    # llama.cpp's editor limits: stop once this long has passed after the first token and a
    # line is done; stop at a line indented less (both finish as "limit"); <= 0: none
    t_max_predict_ms: float = 0
    n_indent: int = 0
    # return just these fields, nested ones flattened as "timings/prompt_n" (llama.vim)
    response_fields: list[str] | None = None
    n_cmpl: Annotated[int, Field(ge=1, le=MAX_COMPLETIONS)] = 1  # completions, one after another

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, stop: list[str]) -> list[str]:
        # more than the engine checks cheaply each token: said, never dropped in silence
        if len(stop) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stop)}")
        return stop


class InfillBody(_LlamaBody):
    """llama.cpp's /infill, as llama.vscode and llama.vim send it."""

    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraChunk] = []
    prompt: str = ""


class LlamaCompletionBody(_LlamaBody):
    """llama.cpp's native /completion (Continue's and Tabby's llama.cpp providers): a text
    prompt or its token ids."""

    prompt: str | list[Annotated[int, Field(ge=0)]]


# ---------------------------------------------------------------- the app


@dataclass
class ServerSettings:
    """What requests default to, and the server's limits.

    model_name: the id reported in responses; context: prompt + max_tokens must fit in it;
    max_tokens: the default budget of a request; sampling: the default sampler; num_draft:
    the default k; drafter: the default drafter ("model", "lookup" or "none"); api_key:
    required as a Bearer token when set; max_body: the largest request body in bytes;
    verify: the default acceptance rule of sampled rounds ("block" or "token"); hosts: the
    Host header names requests may carry (None: any), so a web page that rebinds its own
    DNS name to 127.0.0.1 cannot reach a keyless server on loopback."""

    model_name: str
    context: int
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    num_draft: int | str = "auto"
    drafter: str = "model"
    api_key: str | None = None
    max_body: int = 16 * 2**20
    verify: str = DEFAULT_VERIFY
    hosts: frozenset[str] | None = None


def create_app(
    worker: Worker, settings: ServerSettings, on_ready: Callable[[], None] | None = None
) -> FastAPI:
    """The ASGI app over a started or startable ``worker``; ``on_ready`` runs once serving."""

    @asynccontextmanager
    async def lifespan(_app):
        worker.start()
        if on_ready is not None:
            on_ready()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="specmlx", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(
        _Guard, api_key=settings.api_key, max_body=settings.max_body, hosts=settings.hosts
    )
    app.state.worker, app.state.settings = worker, settings
    _errors(app)
    tok = worker.target.tokenizer
    created = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok", "busy": worker.busy, "queued": worker.queued}

    @app.get("/v1/models")
    async def models():
        card = {"id": settings.model_name, "object": "model", "created": created}
        return {"object": "list", "data": [card | {"owned_by": "specmlx"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        body.refuse_unsupported()
        if body.echo or (body.best_of or 1) > 1:
            raise ApiError(400, "echo and best_of are not supported", code="unsupported")
        _bounded(settings, body.prompt, body.suffix or "")

        def build() -> tuple[list[int], tuple[int, ...]]:
            if body.suffix is not None:
                template = require_fim(tok, _draft_tok(worker, body.draft, settings))
                return encode_infill(tok, template, body.prompt, body.suffix), template.stops
            return _encode(tok, body.prompt), ()

        ids, extra = await _off_loop(build)
        gen = _request(body, ids, extra, body.max_tokens, settings, worker)
        return await _respond(request, worker, gen, body, "text_completion", settings)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        body.refuse_unsupported()
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        _bounded(settings, *(m["content"] for m in messages))

        def build() -> list[int]:
            try:
                ids = tok.apply_chat_template(messages, add_generation_prompt=True)
            except Exception as e:  # jinja raises for role orders a template forbids
                raise ApiError(400, f"the chat template refused these messages: {e}") from None
            return list(ids["input_ids"] if isinstance(ids, dict) else ids)

        ids = await _off_loop(build)
        budget = body.max_completion_tokens or body.max_tokens
        gen = _request(body, ids, (), budget, settings, worker)
        return await _respond(request, worker, gen, body, "chat.completion", settings)

    @app.post("/infill")
    async def infill(body: InfillBody, request: Request):
        template = require_fim(tok, _draft_tok(worker, None, settings))
        extra = [(c.filename, c.text) for c in body.input_extra]
        texts = (body.input_prefix, body.input_suffix, body.prompt, *(t for _, t in extra))
        _bounded(settings, *texts)
        ids = await _off_loop(
            lambda: encode_infill(
                tok, template, body.input_prefix, body.input_suffix, extra=extra, middle=body.prompt
            )
        )
        gen = _llama_request(body, ids, settings, worker, template.stops)
        return await _respond_llama(request, worker, gen, body, settings)

    @app.post("/completion")
    async def completion(body: LlamaCompletionBody, request: Request):
        if isinstance(body.prompt, str):
            _bounded(settings, body.prompt)
            ids = await _off_loop(lambda: _encode(tok, body.prompt))
        else:
            ids = list(body.prompt)
            if not ids:
                raise ApiError(400, "the prompt is empty")
            if max(ids) >= len(tok):
                raise ApiError(400, f"token id {max(ids)} is past the vocabulary")
        gen = _llama_request(body, ids, settings, worker, ())
        return await _respond_llama(request, worker, gen, body, settings)

    @app.get("/props")
    async def props():
        # llama.cpp's: what llama.vscode reads for the context size (one slot: one at a time)
        return {
            "default_generation_settings": _generation_settings(settings, settings.max_tokens),
            "total_slots": 1,
            "model_path": settings.model_name,
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_metrics(worker), media_type="text/plain; version=0.0.4")

    return app


# no tokenizer averages more characters a token than this over a whole prompt (code and prose
# run at 3-5; long runs of spaces at most 16 or so): text longer than the context times this
# cannot fit, and is refused before any tokenizing
MAX_CHARS_PER_TOKEN = 32


def _bounded(settings: ServerSettings, *texts: str) -> None:
    """A 400 before tokenizing when the request's text cannot fit the context."""
    chars = sum(len(t) for t in texts)
    if chars > settings.context * MAX_CHARS_PER_TOKEN:
        raise ApiError(
            400,
            f"the prompt has {chars} characters: more than the context of {settings.context} "
            f"tokens can hold (at most {MAX_CHARS_PER_TOKEN} characters a token)",
            code="context_length_exceeded",
        )


async def _off_loop(fn):
    """Run a prompt's tokenizing in a thread: a long prompt must not stall the event loop
    (every other client's stream and /health) while it is encoded."""
    return await asyncio.to_thread(fn)


def _encode(tok, text: str) -> list[int]:
    if not text:
        raise ApiError(400, "the prompt is empty")
    return encode_prompt(tok, text)


def _draft_tok(worker: Worker, drafter: str | None, settings: ServerSettings):
    """The draft's tokenizer when this request will draft with the model (its FIM ids must
    agree with the target's), else None."""
    use = _drafter(drafter, settings, worker)
    return worker.draft.tokenizer if use == "model" and worker.draft is not None else None


def _drafter(asked: str | None, settings: ServerSettings, worker: Worker) -> str:
    drafter = asked or settings.drafter
    if drafter == "model" and worker.draft is None:
        if asked == "model":
            raise ApiError(400, "this server has no draft model loaded: use draft lookup or none")
        return "none"
    return drafter


def _sampling(body, settings: ServerSettings) -> SamplingParams:
    d = settings.sampling
    pick = lambda v, default: default if v is None else v  # noqa: E731
    try:
        return SamplingParams(
            pick(body.temperature, d.temperature),
            pick(body.top_p, d.top_p),
            pick(body.top_k, d.top_k),
            pick(body.min_p, d.min_p),
        )
    except BadInput as e:
        raise ApiError(400, str(e)) from None


def _budget(prompt_tokens: int, asked: int | None, settings: ServerSettings) -> int:
    """The request's max tokens: as asked (it must fit the context with the prompt), else the
    server's default cut to what the context leaves."""
    room = settings.context - prompt_tokens
    if asked is None:
        if room <= 0:
            raise ApiError(
                400,
                f"the prompt has {prompt_tokens} tokens, the context is {settings.context}",
                code="context_length_exceeded",
            )
        return min(settings.max_tokens, room)
    if asked > room:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens and max_tokens asks for {asked} more: "
            f"{prompt_tokens + asked} > the context of {settings.context}",
            code="context_length_exceeded",
        )
    return asked


def _request(body: _Sampling, ids, extra_eos, asked, settings, worker) -> GenRequest:
    return GenRequest(
        prompt_ids=ids,
        sampling=_sampling(body, settings),
        max_tokens=_budget(len(ids), asked, settings),
        seed=None if body.seed is None or body.seed < 0 else body.seed,
        stop=body.stops(),
        drafter=_drafter(body.draft, settings, worker),
        num_draft=settings.num_draft if body.num_draft is None else body.num_draft,
        extra_eos=tuple(extra_eos),
        verify=_verify(body.verify, settings),
    )


def _verify(asked: str | None, settings: ServerSettings) -> str:
    verify = settings.verify if asked is None else asked
    try:
        sampled_rule(verify)
    except BadInput as e:
        raise ApiError(400, str(e)) from None
    return verify


# ---------------------------------------------------------------- running a job


class _Events:
    """The worker's events for one job, delivered into this event loop."""

    def __init__(self, worker: Worker, gen: GenRequest):
        loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        emit = lambda kind, value: loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))  # noqa: E731
        try:
            self.job = worker.submit(gen, emit)
        except QueueFull as e:
            raise ApiError(503, str(e), "server_error", "overloaded") from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), "server_error", "shutting_down") from None

        self.checked = time.monotonic()
        self.held: tuple | None = None

    async def started(self, request: Request) -> None:
        """Wait for the job's first event before a stream's headers go out: a request that
        fails before its first token (refused while queued at shutdown, say) gets its real
        status instead of a 200 carrying an error event. ClientGone if the client left."""
        self.held = await self.next(request)
        if self.held[0] == "error":
            raise _as_api_error(self.held[1])

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


def _usage(stats: Stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated,
        "total_tokens": stats.prompt_tokens + stats.generated,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def spec_stats(stats: Stats, k_label: str, drafter: str = "", verify: str = DEFAULT_VERIFY) -> dict:
    """The speculative statistics every response carries, under "specmlx"."""
    return {
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_pass": stats.tokens_per_pass,
        "target_passes": stats.rounds,
        "accept_hist": stats.accept_hist,
        "k": k_label,
        "drafter": drafter,
        "verify": verify,
        "last_k": stats.last.k if stats.last else 0,
        "cached_tokens": stats.cached_tokens,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "decode_tps": stats.decode_tps,
        "draft_s": stats.draft_s,
        "target_s": stats.target_s,
        "timed_rounds": stats.timed_rounds,
        "peak_memory": stats.peak_memory,
    }


def _spec(stats: Stats, job: Job) -> dict:
    return spec_stats(stats, job.k_label, job.drafter_name, job.request.verify)


def _sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"


async def _respond(request, worker, gen: GenRequest, body: _Sampling, kind: str, settings):
    events = _Events(worker, gen)
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
                raise _as_api_error(value)
            else:
                stats = value
                break
    except ClientGone:
        return Response(status_code=499)  # nobody reads this
    content = "".join(text)
    choice = {"index": 0, "finish_reason": stats.finish_reason or "stop", "logprobs": None}
    choice |= {"message": {"role": "assistant", "content": content}} if chat else {"text": content}
    if body.return_tokens:
        choice["token_ids"] = tokens
    out = base | {"object": kind, "choices": [choice], "usage": _usage(stats)}
    return out | {"specmlx": _spec(stats, events.job)}


async def _stream(events: _Events, base: dict, chat: bool, usage: bool, with_tokens: bool):
    """OpenAI's chunks as server-sent events, ending with data: [DONE]. If the client goes
    away, Starlette cancels this generator and the job is cancelled with it."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, piece: TokenEvent | None = None) -> dict:
        if chat:
            delta = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        if piece is not None and piece.token is not None:  # the return_tokens extension
            choice["token_ids"], choice["token_from_draft"] = [piece.token], [piece.from_draft]
        return base | {"object": kind, "choices": [choice]}

    try:
        if chat:
            first = chunk("", None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield _sse(first)
        while True:
            what, value = await events.next()
            if what == "piece":
                piece: TokenEvent = value
                if piece.text or (with_tokens and piece.token is not None):
                    yield _sse(chunk(piece.text, None, piece if with_tokens else None))
            elif what == "error":
                err = _as_api_error(value)
                yield _sse(error_body(err.message, err.kind, err.code))
                break
            else:
                stats: Stats = value
                last = chunk(None if chat else "", stats.finish_reason or "stop")
                last["specmlx"] = _spec(stats, events.job)
                yield _sse(last)
                if usage:
                    yield _sse(base | {"object": kind, "choices": [], "usage": _usage(stats)})
                break
        yield _sse("[DONE]")
    finally:
        events.job.cancel()  # no-op when it finished; frees the slot when the client left


def _llama_request(
    body, ids: list[int], settings: ServerSettings, worker: Worker, eos
) -> GenRequest:
    """A llama.cpp-shaped body (/completion, /infill) as one generation of ``ids``."""
    sampling = _sampling(body, settings)
    budget = body.n_predict if body.n_predict > 0 else None
    max_tokens = _budget(len(ids), budget, settings)  # (also: the prompt fits the context)
    if body.n_predict == 0:  # llama.vim's warm-up: fill the prompt cache, predict nothing
        max_tokens = 0
    return GenRequest(
        prompt_ids=ids, sampling=sampling, max_tokens=max_tokens,
        seed=None if body.seed < 0 else body.seed, stop=[s for s in body.stop if s],
        drafter=_drafter(None, settings, worker), num_draft=settings.num_draft,
        extra_eos=tuple(eos), verify=settings.verify,
        time_limit_s=body.t_max_predict_ms / 1000 if body.t_max_predict_ms > 0 else None,
        min_indent=body.n_indent if body.n_indent > 0 else None,
    )  # fmt: skip


async def _respond_llama(request, worker, gen: GenRequest, body, settings: ServerSettings):
    """llama.cpp's response (or, for n_cmpl > 1, a list of them: each completion a seed
    further, so sampled ones differ; greedy ones are the same)."""
    shown = _generation_settings(settings, gen.max_tokens)
    if body.n_cmpl == 1:
        return await _respond_infill(request, worker, gen, body.stream, body.response_fields, shown)
    if body.stream:
        raise ApiError(400, "n_cmpl > 1 cannot stream", code="unsupported")
    seed = gen.seed if gen.seed is not None else random.getrandbits(63)
    out = []
    for i in range(body.n_cmpl):
        one = replace(gen, seed=(seed + i) % 2**64)
        got = await _respond_infill(request, worker, one, False, body.response_fields, shown)
        if isinstance(got, Response):  # the client left
            return got
        out.append(got)
    return out


def _generation_settings(settings: ServerSettings, max_tokens: int) -> dict:
    """llama.cpp's generation_settings, as far as specmlx has them."""
    return {"n_ctx": settings.context, "n_predict": max_tokens, "model": settings.model_name}


def _fields(out: dict, fields: list[str]) -> dict:
    """llama.cpp's response_fields: just these fields; "a/b" is out["a"]["b"] under the key
    "a/b"; a field that is not there is left out."""
    picked = {}
    for name in fields:
        value = out
        for part in name.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            picked[name] = value
    return picked


async def _respond_infill(
    request: Request,
    worker: Worker,
    gen: GenRequest,
    stream: bool,
    fields: list[str] | None = None,
    generation_settings: dict | None = None,
):
    """llama.cpp's /completion response shape: content, stop, tokens, timings (just
    ``fields`` when given)."""
    events = _Events(worker, gen)

    def final(content: str, stats: Stats) -> dict:
        out = full(content, stats)
        return out if fields is None else _fields(out, fields)

    def full(content: str, stats: Stats) -> dict:
        stop_type = {"length": "limit", "limit": "limit", "stop": "eos"}.get(
            stats.finish_reason or "", "eos"
        )
        prompt_n = stats.prompt_tokens - stats.cached_tokens
        return {
            "content": content,
            "stop": True,
            "stop_type": stop_type,
            "tokens_predicted": stats.generated,
            "tokens_evaluated": stats.prompt_tokens,
            "tokens_cached": stats.cached_tokens,
            "truncated": False,
            "timings": {
                "prompt_n": prompt_n,
                "prompt_ms": stats.prefill_s * 1000,
                "prompt_per_token_ms": stats.prefill_s * 1000 / prompt_n if prompt_n else 0.0,
                "prompt_per_second": stats.prompt_tps,
                "predicted_n": stats.generated,
                "predicted_ms": stats.decode_s * 1000,
                "predicted_per_token_ms": (
                    stats.decode_s * 1000 / stats.generated if stats.generated else 0.0
                ),
                "predicted_per_second": stats.decode_tps,
                "draft_n": stats.drafted,
                "draft_n_accepted": stats.accepted,
            },
            "generation_settings": generation_settings or {},
            "specmlx": _spec(stats, events.job),
        }

    if stream:

        async def chunks() -> AsyncIterator[str]:
            try:
                while True:
                    what, value = await events.next()
                    if what == "piece" and value.text:
                        yield _sse({"content": value.text, "stop": False})
                    elif what == "error":
                        err = _as_api_error(value)
                        yield _sse(error_body(err.message, err.kind, err.code))
                        return
                    elif what == "done":
                        yield _sse(final("", value))
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
                raise _as_api_error(value)
            else:
                return final("".join(text), value)
    except ClientGone:
        return Response(status_code=499)


def _as_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), "server_error", "shutting_down")
    if isinstance(e, RankFailure):
        return ApiError(503, str(e), "server_error", "rank_failed")
    if isinstance(e, SpecmlxError) and e.exit_code == 2:
        return ApiError(400, str(e))
    _log_failure("a generation failed", e)
    return ApiError(500, "generation failed (logged by the server)", "server_error")


def _log_failure(what: str, e: BaseException) -> None:
    """One line on the server's stderr for a failure the client gets only a 500 for."""
    print(f"specmlx serve: {what}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- errors, auth, limits


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request, e: ApiError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(error_body(e.message, e.kind, e.code), e.status, headers=headers)

    @app.exception_handler(SpecmlxError)
    async def domain_error(_request, e: SpecmlxError):
        err = _as_api_error(e)
        return JSONResponse(error_body(err.message, err.kind, err.code), err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        what = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            msg = "the request body is not valid JSON"
        elif not where and first.get("type") != "value_error":  # empty, null, a list
            msg = "the request body must be a JSON object"
        else:
            msg = f"{where}: {what}" if where else what
        return JSONResponse(error_body(msg, "invalid_request_error", None, where or None), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_request, e: Exception):
        # the details go to the server's log, not to the client (they can name paths)
        _log_failure("a request failed", e)
        return JSONResponse(
            error_body("internal error (logged by the server)", "server_error"), 500
        )


def host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class _Guard:
    """ASGI middleware: the Host header (when the server names its hosts), the Bearer API
    key (all but /health) and the body size limit (413, chunked bodies too)."""

    def __init__(
        self,
        app,
        api_key: str | None,
        max_body: int,
        hosts: frozenset[str] | None,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ):
        self.app, self.api_key, self.max_body, self.hosts = app, api_key, max_body, hosts
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.hosts is not None and host_name(headers.get("host", "")) not in self.hosts:
            msg = "this server does not answer to that Host name (see --allow-host)"
            body = error_body(msg, "invalid_request_error", "invalid_host")
            return await JSONResponse(body, 400)(scope, receive, send)
        if self.api_key and scope["path"] != "/health":
            scheme, _, given = headers.get("authorization", "").strip().partition(" ")
            # the scheme is case-insensitive (RFC 9110); the key compared in constant time
            ok = scheme.lower() == "bearer" and hmac.compare_digest(
                given.strip().encode(), self.api_key.encode()
            )
            if not ok:
                msg = "a missing or wrong API key: send Authorization: Bearer <key>"
                body = error_body(msg, "invalid_request_error", "invalid_api_key")
                return await JSONResponse(body, 401)(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._too_large(scope, receive, send)
        # read the body here, counting (a chunked one has no length to check first), and
        # hand the app a replay: an oversized body is a 413 before the app sees any of it
        chunks, seen, more = [], 0, True
        while more:
            try:  # a client that stops sending mid-body must not hold the connection for ever
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except TimeoutError:
                msg = f"the request body did not arrive within {self.body_timeout_s:g} s"
                body = error_body(msg, "invalid_request_error", "timeout")
                return await JSONResponse(body, 408)(scope, receive, send)
            if message["type"] != "http.request":  # the client went away
                return None
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_body:
                return await self._too_large(scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then what the server says next (a disconnect)

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        msg = f"the request body is larger than {self.max_body} bytes"
        await JSONResponse(error_body(msg, "invalid_request_error", "too_large"), 413)(
            scope, receive, send
        )


# ---------------------------------------------------------------- metrics


def _metrics(worker: Worker) -> str:
    t, cache = worker.totals, worker.cache
    rows = [
        ("requests_total", "counter", "generations run", t.requests),
        ("requests_cancelled_total", "counter", "generations cancelled by the client", t.cancelled),
        ("requests_failed_total", "counter", "generations that failed", t.failed),
        ("requests_rejected_total", "counter", "requests refused with 503", t.rejected),
        ("prompt_tokens_total", "counter", "prompt tokens", t.prompt_tokens),
        ("prompt_cache_tokens_total", "counter", "prompt tokens served from the cache", t.cached_tokens),
        ("prompt_cache_hits_total", "counter", "requests that reused cached tokens", t.cache_hits),
        ("prompt_cache_bytes", "gauge", "bytes of KV caches kept", cache.nbytes),
        ("prompt_cache_entries", "gauge", "sequences kept", len(cache.entries)),
        ("generated_tokens_total", "counter", "tokens generated", t.generated),
        ("drafted_tokens_total", "counter", "tokens drafted", t.drafted),
        ("accepted_tokens_total", "counter", "drafts accepted", t.accepted),
        ("target_passes_total", "counter", "target forward passes", t.rounds),
        ("acceptance_rate", "gauge", "accepted / drafted", t.accepted / t.drafted if t.drafted else 0.0),
        ("tokens_per_pass", "gauge", "generated / target passes", t.generated / t.rounds if t.rounds else 0.0),
        ("decode_tokens_per_second", "gauge", "generated / decode seconds", t.generated / t.decode_s if t.decode_s else 0.0),
        ("decode_seconds_total", "counter", "seconds spent decoding", t.decode_s),
        ("prefill_seconds_total", "counter", "seconds spent prefilling", t.prefill_s),
        ("queue_depth", "gauge", "requests waiting", worker.queued),
        ("busy", "gauge", "1 while a generation runs", int(worker.busy)),
    ]  # fmt: skip
    out = []
    for name, kind, help_, value in rows:
        out += [f"# HELP specmlx_{name} {help_}", f"# TYPE specmlx_{name} {kind}"]
        out.append(f"specmlx_{name} {value}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- serving


def run_server(app: FastAPI, host: str, port: int, *, grace_s: float = 10.0) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then stop cleanly: no new connections; queued
    requests are answered at once with a 503 shutting_down; the running one gets most of
    ``grace_s`` seconds to finish, and is then ended with a final error event (a stream) or a
    503; this returns normally (the command exits 0)."""
    import uvicorn

    worker: Worker = app.state.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            # a requested stop is a clean one: do not re-raise the signal afterwards
            getattr(self, "_captured_signals", []).clear()
            if first:
                worker.drain()
                # before uvicorn's own grace runs out and cuts the connection mid-stream
                end = threading.Timer(max(grace_s - 1.0, grace_s * 0.8), worker.interrupt)
                end.daemon = True
                end.start()

    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace_s,
        limit_concurrency=MAX_CONNECTIONS,
    )  # fmt: skip
    Server(config).run()
