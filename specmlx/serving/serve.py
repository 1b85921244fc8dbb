"""`specmlx serve`: an OpenAI-compatible HTTP server over one loaded pair.

FastAPI validates requests (api_schemas), which are tokenized here and handed to the worker
thread (the only thread that runs MLX); text streams back as server-sent events in OpenAI's
chunk format (responses, api_shapes). Endpoints: /health, /v1/models, /v1/completions (with `suffix`
for fill-in-the-middle), /v1/chat/completions, llama.cpp's /infill (editor plugins), and
/metrics (Prometheus: metrics). Every error is OpenAI's {"error": {"message", "type",
"code"}} with a 4xx status for bad input (api_errors), and the server keeps serving; the
Host check, API key and body limits sit in front of every route (guard), and every request
leaves an access log line (access_log). The editors' routes fit a prompt past the context
as llama-server does (fitting), where the OpenAI routes refuse it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..core.acceptance import DEFAULT_VERIFY, sampled_rule
from ..core.sampling import SamplingParams
from ..decoding import session
from ..decoding.fim import encode_infill, require_fim
from ..decoding.stream import chat_ids, encode_prompt
from ..drafting.choosing.choosers import AUTO, K
from ..drafting.choosing.tree_size import AUTO as TREE_AUTO
from ..drafting.choosing.tree_size import TreeSize
from ..drafting.lookup.kinds import SUFFIX, LookupKind
from ..errors import BadInput, parsed
from . import api_shapes as shapes
from .access_log import SERVER, AccessLog
from .api_errors import ApiError, install_error_handlers
from .api_schemas import ChatBody, CompletionBody, InfillBody, LlamaCompletionBody, SamplingBody
from .fitting import (
    MAX_CHARS_PER_TOKEN,
    answer_room,
    completion_ids,
    fit_completion,
    fit_infill,
    infill_window,
)
from .guard import HEADER_TIMEOUT_S, Guard, HeaderDeadline
from .metrics import CONTENT_TYPE, ServerMetrics
from .responses import respond, respond_llama
from .worker import Worker

# open connections uvicorn holds at once (then a 503): one still sending its head or body
# holds one until its deadline (guard.py), so there are many more than the requests the
# app works on at once (guard.MAX_REQUESTS); asyncio holds thousands of idle ones
MAX_CONNECTIONS = 1024
_log = logging.getLogger(SERVER)


# ---------------------------------------------------------------- the app


@dataclass
class ServerSettings:
    """What requests default to, and the server's limits.

    model_name: the id reported in responses; context: prompt + max_tokens must fit in it;
    max_tokens: the default budget of a request; sampling: the default sampler; k:
    the default k; drafter: the default drafter (a session.DrafterChoice); api_key:
    required as a Bearer token when set; max_body: the largest request body in bytes;
    verify: the default acceptance rule of sampled rounds ("block" or "token"); hosts: the
    Host header names requests may carry (None: any), so a web page that rebinds its own
    DNS name to 127.0.0.1 cannot reach a keyless server on loopback; tree: token trees for a
    request that runs alone (a batch's rows verify chains: they already widen the pass);
    lookup: how lookup proposes for a request that asks for it (a kinds.LookupKind)."""

    model_name: str
    context: int
    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    k: K = AUTO
    drafter: session.DrafterChoice = session.MODEL
    api_key: str | None = None
    max_body: int = 16 * 2**20
    verify: str = DEFAULT_VERIFY
    hosts: frozenset[str] | None = None
    tree: TreeSize = TREE_AUTO
    lookup: LookupKind = SUFFIX

    def __post_init__(self) -> None:
        parsed(self.k, K, "k"), parsed(self.tree, TreeSize, "tree")  # (parsed at the edge)
        (
            parsed(self.drafter, session.DrafterChoice, "drafter"),
            parsed(self.lookup, LookupKind, "lookup"),
        )


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

    # no /docs, so no /openapi.json either: the schema would only tell a stranger the routes
    app = FastAPI(
        title="specmlx", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.add_middleware(
        Guard, api_key=settings.api_key, max_body=settings.max_body, hosts=settings.hosts
    )
    app.add_middleware(AccessLog)  # outside the Guard: its refusals get a line too
    prometheus = ServerMetrics(worker)
    app.state.worker, app.state.settings, app.state.metrics = worker, settings, prometheus
    install_error_handlers(app)
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
        return await respond(request, worker, gen, body, "text_completion", settings)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        body.refuse_unsupported()
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, "this model has no chat template: use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        _bounded(settings, *(m["content"] for m in messages))

        def build() -> list[int]:
            try:
                return chat_ids(tok, messages)
            except Exception as e:  # jinja raises for role orders a template forbids
                raise ApiError(400, f"the chat template refused these messages: {e}") from None

        ids = await _off_loop(build)
        # llama-server's own n_predict wins over OpenAI's fields there (llama.vim's instruct
        # mode sends 0 as a warm-up: prefill, generate nothing); < 0 is the default budget
        n_predict = body.n_predict
        budget = body.max_completion_tokens or body.max_tokens
        if n_predict is not None:
            budget = n_predict if n_predict > 0 else None
        gen = _request(body, ids, (), budget, settings, worker)
        gen.warm_up = n_predict == 0
        return await respond(request, worker, gen, body, "chat.completion", settings)

    # the editors' routes fit every prompt to the context as llama-server does (fitting.py),
    # where the OpenAI routes refuse one that does not fit: an editor shows no error, so a
    # refusal there was a suggestion that never came
    room = answer_room(settings.context, settings.max_tokens)
    # the other files' share of a prompt cut to fit: none at a small context (llama.vim's
    # sizes fill 2048 tokens with the cursor's window)
    extra_room = infill_window(settings.context, room)[1]
    app.state.extra_cut = False  # the latest editor request's other files were all cut

    @app.post("/infill")
    async def infill(body: InfillBody, request: Request):
        template = require_fim(tok, _draft_tok(worker, None, settings))
        extra = [(c.filename, c.text) for c in body.input_extra]
        fit = await _off_loop(
            lambda: fit_infill(
                tok, template, body.input_prefix, body.input_suffix, extra=extra,
                middle=body.prompt, context=settings.context, room=room,
            )
        )  # fmt: skip
        ids = fit.ids
        if body.n_predict != 0:  # a suggestion: did its other files reach the model?
            cut = bool(extra) and fit.truncated and extra_room == 0
            if cut and not app.state.extra_cut:
                _log.warning(
                    "/infill: at a context of %d no other files (input_extra) fit beside the "
                    "cursor's window: warm-ups are answered without a prefill",
                    settings.context,
                )  # fmt: skip
            app.state.extra_cut = cut
        elif app.state.extra_cut:  # a warm-up of chunks that no suggestion would keep
            ids = ids[-1:]  # (nothing to prefill: the last token is never cached)
        gen = _llama_request(body, ids, settings, worker, template.stops)
        return await respond_llama(request, worker, gen, body, settings, fit.truncated, True)

    @app.post("/completion")
    async def completion(body: LlamaCompletionBody, request: Request):
        cut = False
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise ApiError(400, "the prompt is empty")
            ids, cut = await _off_loop(
                lambda: completion_ids(tok, body.prompt, settings.context, body.n_keep)
            )
        else:
            ids = list(body.prompt)
            if not ids:
                raise ApiError(400, "the prompt is empty")
            if max(ids) >= len(tok):
                raise ApiError(400, f"token id {max(ids)} is past the vocabulary")
        bos = getattr(tok, "bos_token_id", None)
        fit = fit_completion(ids, settings.context, room, body.n_keep, bos)
        gen = _llama_request(body, fit.ids, settings, worker, ())
        return await respond_llama(request, worker, gen, body, settings, cut or fit.truncated)

    @app.get("/props")
    async def props():
        # llama.cpp's: what llama.vscode reads for the context size; its slots are the
        # requests decoded at once, here the worker's batch rows (1 where it cannot batch)
        return {
            "default_generation_settings": shapes.generation_settings(
                settings.model_name, settings.context, settings.max_tokens
            ),
            "total_slots": worker.slots,
            "model_path": settings.model_name,
            # specmlx's own: whether the latest suggestion kept any of input_extra (False:
            # the context leaves them no room, and warm-ups are not prefilled)
            "input_extra_fits": not app.state.extra_cut,
        }

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus.exposition(), media_type=CONTENT_TYPE)

    return app


def _bounded(settings: ServerSettings, *texts: str) -> None:
    """A 400 before tokenizing when the request's text cannot fit the context (the OpenAI
    routes: the editors' routes fit theirs instead)."""
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
    return worker.draft.tokenizer if use == session.MODEL and worker.draft is not None else None


def _drafter(asked: str | None, settings: ServerSettings, worker: Worker) -> session.DrafterChoice:
    """What drafts a request: its body's "draft" (parsed here, lookup the server's kind) or
    the server's default; a 400 for the draft model where none is loaded."""
    try:
        drafter = (
            settings.drafter if asked is None else session.DrafterChoice.of(asked, settings.lookup)
        )
    except BadInput as e:
        raise ApiError(400, str(e)) from None
    if drafter == session.MODEL and worker.draft is None:
        if asked is not None:
            raise ApiError(400, "this server has no draft model loaded: use draft lookup or none")
        return drafter.without_model()
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


def _request(body: SamplingBody, ids, extra_eos, asked, settings, worker) -> session.Request:
    return session.Request(
        prompt_ids=ids,
        sampling=_sampling(body, settings),
        max_tokens=_budget(len(ids), asked, settings),
        seed=None if body.seed is None or body.seed < 0 else body.seed,
        stop=body.stops(),
        drafter=_drafter(body.draft, settings, worker),
        k=settings.k if body.num_draft is None else K.of(body.num_draft, "num_draft"),
        extra_eos=tuple(extra_eos),
        verify=_verify(body.verify, settings),
        tree=settings.tree,
    )


def _verify(asked: str | None, settings: ServerSettings) -> str:
    verify = settings.verify if asked is None else asked
    try:
        sampled_rule(verify)
    except BadInput as e:
        raise ApiError(400, str(e)) from None
    return verify


def _llama_request(
    body, ids: list[int], settings: ServerSettings, worker: Worker, eos
) -> session.Request:
    """A llama.cpp-shaped body (/completion, /infill) as one generation of ``ids``, a prompt
    fitted to the context (fitting.py): an answer asked longer than the room it left stops
    at the context's end, as llama-server's does."""
    sampling = _sampling(body, settings)
    asked = body.n_predict if body.n_predict > 0 else settings.max_tokens
    max_tokens = max(1, min(asked, settings.context - len(ids)))
    return session.Request(
        prompt_ids=ids, sampling=sampling, max_tokens=max_tokens,
        warm_up=body.n_predict == 0,  # llama.vim's: fill the prompt cache, predict nothing
        cache_prompt=body.cache_prompt,
        seed=None if body.seed < 0 else body.seed, stop=[s for s in body.stop if s],
        drafter=_drafter(None, settings, worker), k=settings.k,
        extra_eos=tuple(eos), verify=settings.verify, tree=settings.tree,
        time_limit_s=body.t_max_predict_ms / 1000 if body.t_max_predict_ms > 0 else None,
        min_indent=body.n_indent if body.n_indent > 0 else None,
    )  # fmt: skip


# ---------------------------------------------------------------- serving


def run_server(
    app: FastAPI,
    host: str,
    port: int,
    *,
    grace_s: float = 10.0,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then stop cleanly: no new connections; queued
    requests are answered at once with a 503 shutting_down; the running one gets most of
    ``grace_s`` seconds to finish, and is then ended with a final error event (a stream) or a
    503; this returns normally (the command exits 0).

    app: from create_app; host, port: where to listen; grace_s: as above;
    header_timeout_s: the longest a request's line and headers may take (then a 408)."""
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

    protocol = type("Deadline", (HeaderDeadline,), {"header_timeout_s": header_timeout_s})
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace_s,
        limit_concurrency=MAX_CONNECTIONS, http=protocol,
    )  # fmt: skip
    Server(config).run()
