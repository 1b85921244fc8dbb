"""The server's errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

ApiError carries an HTTP status; ``as_api_error`` maps what the worker and the engine raise
to one, and ``install_error_handlers`` makes every failure a JSON answer (4xx for bad input;
a 500 names no exception text, which can name paths: the server's log has it).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..distributed.ranks import RankFailure
from ..errors import SpecmlxError
from .worker import ShuttingDown


class ApiError(Exception):
    """An error with an HTTP status, in OpenAI's shape.

    status: the HTTP status; message: what the client is told; kind: OpenAI's error type;
    code: OpenAI's error code (None: none)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error body.

    message: what the client is told; kind: the error type ("invalid_request_error",
    "server_error", ...); code: the error code, if any; param: the request field at fault,
    if any."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def as_api_error(e: BaseException) -> ApiError:
    """The ApiError a client gets for ``e``, a failure of its request: a stop or a lost rank
    is a 503, bad input (exit code 2) a 400, anything else a 500 that says only that the
    server logged it."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ShuttingDown):
        return ApiError(503, str(e), "server_error", "shutting_down")
    if isinstance(e, RankFailure):
        return ApiError(503, str(e), "server_error", "rank_failed")
    if isinstance(e, SpecmlxError) and e.exit_code == 2:
        return ApiError(400, str(e))
    log_failure("a generation failed", e)
    return ApiError(500, "generation failed (logged by the server)", "server_error")


def log_failure(what: str, e: BaseException) -> None:
    """One line in the server's log (its stderr) for a failure the client gets only a 500
    for: through logging, so `specmlx serve --log-format json` writes it as JSON too.

    what: what failed, in a few words; e: the exception (its type and message are logged)."""
    logging.getLogger("specmlx.serve").error(f"specmlx serve: {what}: {type(e).__name__}: {e}")


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error ``app`` raises in OpenAI's shape (ApiError with its status and, for
    a 503, Retry-After; FastAPI's validation errors as a 400 naming the field; Starlette's
    404/405 and the like; anything unexpected as a logged 500)."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError):
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(error_body(e.message, e.kind, e.code), e.status, headers=headers)

    @app.exception_handler(SpecmlxError)
    async def domain_error(_request: Request, e: SpecmlxError):
        err = as_api_error(e)
        return JSONResponse(error_body(err.message, err.kind, err.code), err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError):
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
    async def http_error(_request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, e: Exception):
        # the details go to the server's log, not to the client (they can name paths)
        log_failure("a request failed", e)
        return JSONResponse(
            error_body("internal error (logged by the server)", "server_error"), 500
        )
