"""`specmlx run --server URL`: the same request sent to a running `specmlx serve`.

The server streams OpenAI chunks; this turns them back into the text pieces and the Stats
that `specmlx run` renders, so the command keeps its contract (text on stdout, statistics on
stderr, --json, exit codes) whether the models are loaded here or there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from ..core.stats import RoundReport, Stats, TokenEvent
from ..errors import BadInput, SpecmlxError


class ServerError(SpecmlxError):
    """The server is unreachable or failed (exit code 1)."""


@dataclass
class Remote:
    """Where the server is, and the key it wants (None: none)."""

    url: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(
    request, draft: str | None = None, k: int | str | None = None, verify: str | None = None
) -> dict:
    """The OpenAI body of ``request`` (a session.Request: its budget, sampling, stops and
    seed), without its prompt or messages. draft, k, verify: sent only where given (None:
    the server fills in its own drafter, k and rule)."""
    sampling = request.sampling
    body: dict = {
        "max_tokens": request.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "stop": list(request.stop) or None,
        "seed": request.seed,
    }
    if draft is not None:
        body["draft"] = draft
    if k is not None:
        body["num_draft"] = k
    if verify is not None:
        body["verify"] = verify
    return body


def stream_remote(
    remote: Remote,
    body: dict,
    stats: Stats,
    *,
    chat: bool = False,
    names: dict | None = None,
    timeout: float = 600.0,
) -> Iterator[TokenEvent]:
    """POST ``body`` (an OpenAI completion or chat request, streamed) and yield the pieces.

    stats: filled from the server's statistics as they arrive; chat: send to the chat
    endpoint (``body`` has messages); names: gets "model", "drafter" and "verify" as the
    server names them; timeout: seconds without a byte from the server before giving up.
    BadInput for a 4xx answer, ServerError when the server cannot be reached or fails."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    url = remote.url.rstrip("/") + path
    body = body | {"stream": True, "stream_options": {"include_usage": True}}
    body["return_tokens"] = True
    try:
        with httpx.stream(
            "POST", url, json=body, headers=remote.headers(), timeout=timeout
        ) as response:
            if response.status_code >= 400:
                response.read()
                raise _http_error(response)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ServerError(f"the server failed: {chunk['error'].get('message')}")
                if names is not None:
                    names["model"] = chunk.get("model", names.get("model"))
                    spec = chunk.get("specmlx", {})
                    names["drafter"] = spec.get("drafter", names.get("drafter"))
                    names["verify"] = spec.get("verify", names.get("verify"))
                yield from _pieces(chunk, stats, chat)
    except httpx.TransportError as e:
        raise ServerError(f"cannot reach the specmlx server at {remote.url}: {e}") from None


def _pieces(chunk: dict, stats: Stats, chat: bool) -> Iterator[TokenEvent]:
    if chunk.get("usage"):
        usage = chunk["usage"]
        stats.prompt_tokens, stats.generated = usage["prompt_tokens"], usage["completion_tokens"]
        stats.cached_tokens = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    if "specmlx" in chunk:
        fill_stats(stats, chunk["specmlx"])
    for choice in chunk.get("choices", []):
        text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        tokens = choice.get("token_ids") or []
        flags = choice.get("token_from_draft") or [False] * len(tokens)
        if choice.get("finish_reason"):
            stats.finish_reason = choice["finish_reason"]
        if tokens:
            stats.generated += len(tokens)
            for i, (tok, fd) in enumerate(zip(tokens, flags, strict=False)):
                yield TokenEvent(tok, fd, text if i == len(tokens) - 1 else "")
        elif text:
            yield TokenEvent(None, False, text)


def fill_stats(stats: Stats, spec: dict) -> None:
    """Copy the server's speculative statistics into ``stats``."""
    stats.drafted, stats.accepted = spec["drafted"], spec["accepted"]
    stats.rounds, stats.accept_hist = spec["target_passes"], list(spec["accept_hist"])
    stats.cached_tokens = spec.get("cached_tokens", stats.cached_tokens)
    stats.prefill_s, stats.decode_s = spec["prefill_s"], spec["decode_s"]
    stats.peak_memory = spec.get("peak_memory", 0)
    # the draft/target split: the server's estimate, carried as one timed "round"
    if stats.drafted and spec.get("draft_s"):
        stats.timed_rounds, stats.timed_drafted = spec.get("timed_rounds", 1), stats.drafted
        stats.timed_draft_s = spec["draft_s"]
    stats.last = RoundReport(spec.get("last_k", 0), 0, 0.0)


def _http_error(response: httpx.Response) -> SpecmlxError:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:200] or response.reason_phrase
    if 400 <= response.status_code < 500:
        return BadInput(f"the server refused the request ({response.status_code}): {message}")
    return ServerError(f"the server failed ({response.status_code}): {message}")
