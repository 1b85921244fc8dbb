"""The server's ASGI middleware, in front of every route: the Host header (when the server
names its hosts), the Bearer API key (all but /health), the body size limit (a 413, chunked
bodies too) and the body timeout (a 408 for a client that stops sending mid-body); and,
below ASGI, a deadline for a request's headers (HeaderDeadline, uvicorn's HTTP/1.1 protocol
with one timer added).

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

BODY_TIMEOUT_S = 30.0  # the longest wait for the next piece of a request body (then a 408)
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
    timeout (408).

    app: the ASGI app behind it; api_key: the key requests must send as a Bearer token (None
    or empty: none needed); max_body: the largest request body in bytes; hosts: the Host
    names requests may carry (None: any); body_timeout_s: the longest wait for the next
    piece of a body."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body: int,
        hosts: frozenset[str] | None,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ):
        self.app, self.api_key, self.max_body, self.hosts = app, api_key, max_body, hosts
        self.body_timeout_s = body_timeout_s

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
        while more:
            try:  # a client that stops sending mid-body must not hold the connection for ever
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
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

        return await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        msg = f"the request body is larger than {self.max_body} bytes"
        await JSONResponse(error_body(msg, "invalid_request_error", "too_large"), 413)(
            scope, receive, send
        )


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline for each request's line and headers.

    uvicorn has none: a client that connects and then trickles its headers (or sends
    nothing) holds one of the server's few connection slots for as long as it likes
    (slowloris). The deadline starts when a connection opens and when the first byte of a
    later request arrives on it (between requests uvicorn's keep-alive timeout applies), and
    ends when h11 has the whole head; past it the client gets a 408 and the connection
    closes. ``header_timeout_s`` is a class attribute: serve.run_server makes a subclass
    with the server's value."""

    header_timeout_s = HEADER_TIMEOUT_S

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
