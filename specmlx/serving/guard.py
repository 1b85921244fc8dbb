"""The server's ASGI middleware, in front of every route: the Host header (when the server
names its hosts), the Bearer API key (all but /health), the body size limit (a 413, chunked
bodies too) and the body deadline (a 408 for a body not whole in time); and, below ASGI,
uvicorn's HTTP/1.1 protocol with a deadline for a request's headers and the server's own
answers to what uvicorn refuses itself (HeaderDeadline: malformed HTTP, the connection
limit).

It answers each refusal itself in OpenAI's error shape; the app sees only requests that
passed, with their whole body already read.
"""

from __future__ import annotations

import asyncio
import hmac
import json

import h11
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from .api_errors import error_body

BODY_TIMEOUT_S = 30.0  # the longest a request's whole body may take (then a 408)
# requests the app works on at once, each with its whole body (then a 503): a connection
# still sending its head or body does not count, so clients trickling bodies in (each let
# go at its deadline) keep no ordinary request out; uvicorn's connection cap, far higher,
# and the body limit bound what they hold meanwhile
MAX_REQUESTS = 64
HEADER_TIMEOUT_S = 10.0  # the longest a request's line and headers may take (then a 408)


def host_name(header: str) -> str:
    """The name in a Host header, without its port ("[::1]:8080" -> "::1").

    header: the Host header's value as sent."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: the Host header (when the server names its hosts), the Bearer API
    key (all but /health), the body size limit (413, chunked bodies too) and the body
    deadline (408).

    app: the ASGI app behind it; api_key: the key requests must send as a Bearer token (None
    or empty: none needed); max_body: the largest request body in bytes; hosts: the Host
    names requests may carry (None: any); body_timeout_s: the longest the whole body may
    take to arrive, counted from when its headers are in; max_requests: requests with
    their whole body the app may work on at once (past it a 503 with Retry-After)."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body: int,
        hosts: frozenset[str] | None,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_requests: int = MAX_REQUESTS,
    ):
        self.app, self.api_key, self.max_body, self.hosts = app, api_key, max_body, hosts
        self.body_timeout_s, self.max_requests = body_timeout_s, max_requests
        self.working = 0  # requests in the app now (the event loop's one thread counts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        # one deadline for the whole body, not one per piece: a client that sends a byte
        # every few seconds, each piece in time, held its connection slot for ever (and the
        # server has few: enough such clients locked everyone else out)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        while more:
            try:
                left = max(0.0, deadline - loop.time())
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:  # not the builtin TimeoutError before 3.11
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

        if self.working >= self.max_requests:
            msg = f"the server is working on all the requests it can ({self.max_requests})"
            body = error_body(msg, "server_error", "overloaded")
            headers = {"Retry-After": str(HeaderDeadline.retry_after_s), "Connection": "close"}
            return await JSONResponse(body, 503, headers=headers)(scope, receive, send)
        self.working += 1
        try:
            return await self.app(scope, replay, send)
        finally:
            self.working -= 1

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        msg = f"the request body is larger than {self.max_body} bytes"
        await JSONResponse(error_body(msg, "invalid_request_error", "too_large"), 413)(
            scope, receive, send
        )


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's line and headers, and
    the server's JSON errors where uvicorn answers in plain text.

    The deadline: uvicorn has none, so a client that connects and then trickles its headers
    (or sends nothing) held one of the server's few connection slots for as long as it
    liked (slowloris). It starts when a connection opens and when the first byte of a later
    request arrives on it (between requests uvicorn's keep-alive timeout applies), and ends
    when h11 has the whole head; past it the client gets a 408 and the connection closes.
    ``header_timeout_s`` is a class attribute: serve.run_server makes a subclass with the
    server's value.

    The answers: a request h11 cannot parse gets a 400, and one past uvicorn's
    ``limit_concurrency`` a 503 with Retry-After, both in OpenAI's error shape like every
    other refusal (uvicorn's own are plain text, the 503 with no Retry-After)."""

    header_timeout_s = HEADER_TIMEOUT_S
    retry_after_s = 1  # what a client refused at the connection limit is told to wait

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn picks its plain-text 503 inside handle_events, where no subclass can reach:
        # take the limit over instead, and check it where each request's app starts
        self.max_connections, self.limit_concurrency = self.limit_concurrency, None
        if self.max_connections is not None:
            self._app, self.app = self.app, self._limited

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, or the 503 uvicorn's limit_concurrency gives: this connection counts
        among the open ones, and this request's task among the running ones (uvicorn counts
        the tasks before adding the new one: hence ``>``)."""
        if scope["type"] == "http" and (
            len(self.connections) >= self.max_connections or len(self.tasks) > self.max_connections
        ):
            self.logger.warning("Exceeded concurrency limit.")  # as uvicorn logs it
            msg = f"the server is serving all the connections it can ({self.max_connections})"
            body = error_body(msg, "server_error", "overloaded")
            headers = {"Retry-After": str(self.retry_after_s), "Connection": "close"}
            return await JSONResponse(body, 503, headers=headers)(scope, receive, send)
        return await self._app(scope, receive, send)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot parse, in OpenAI's error shape.

        msg: uvicorn's words for it (logged by uvicorn; the client gets its own)."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.close()  # a response is already under way: no room for another
            return
        text = "the request is not valid HTTP/1.1"
        body = json.dumps(error_body(text, "invalid_request_error", "bad_request")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # IDLE: h11 has not yet seen a whole request line and headers
        if self.conn.their_state is h11.IDLE:
            self._arm()
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        msg = f"the request headers did not arrive within {self.header_timeout_s:g} s"
        body = json.dumps(error_body(msg, "invalid_request_error", "timeout")).encode()
        head = (
            "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()
