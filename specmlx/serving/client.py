"""`specmlx run --server URL` and `specmlx chat --server URL`: the same requests sent to a
running `specmlx serve`.

The server streams OpenAI chunks; this turns them back into the text pieces and the Stats
that `specmlx run` renders, so the command keeps its contract (text on stdout, statistics on
stderr, --json, exit codes) whether the models are loaded here or there. ``RemoteChat`` holds
a conversation whose turns go to the chat endpoint, the server's prompt cache keeping the
turns before.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from ..core.stats import RoundReport, Stats, TokenEvent
from ..decoding.conversation import Conversation
from ..errors import BadInput, SpecmlxError


class ServerError(SpecmlxError):
    """The server is unreachable or failed (exit code 1)."""


class ContextExceeded(BadInput):
    """The server refused a prompt that, with its max_tokens, does not fit its context."""


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
    try:
        code = response.json()["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        code = None
    if 400 <= response.status_code < 500:
        kind = ContextExceeded if code == "context_length_exceeded" else BadInput
        return kind(f"the server refused the request ({response.status_code}): {message}")
    return ServerError(f"the server failed ({response.status_code}): {message}")


def model_name(remote: Remote, timeout: float = 30.0) -> str:
    """The model the server serves (its /v1/models). ServerError when it cannot be reached,
    BadInput when it refuses (a wrong API key)."""
    try:
        response = httpx.get(
            remote.url.rstrip("/") + "/v1/models", headers=remote.headers(), timeout=timeout
        )
    except httpx.TransportError as e:
        raise ServerError(f"cannot reach the specmlx server at {remote.url}: {e}") from None
    if response.status_code >= 400:
        raise _http_error(response)
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerError(f"{remote.url} answered /v1/models with no model") from None


class RemoteChat:
    """A conversation held with a running server: each turn sends every message to its chat
    endpoint (whose prompt cache prefills only what is new); where the server says the
    conversation no longer fits its context, the oldest turns go (the system prompt stays)
    until it does.

    remote: the server; body: the OpenAI fields each turn sends besides its messages
    (``request_body``); system: the system prompt (None: none); say: told of the turns
    dropped, before the reply's first piece."""

    def __init__(self, remote: Remote, body: dict, system: str | None = None, say=None):
        self.remote, self.body, self.say = remote, body, say or (lambda _msg: None)
        self.conversation = Conversation(system)
        self.names = {"model": "?", "drafter": "?"}  # as the server names them

    def reply(self, text: str, stats: Stats) -> Iterator[TokenEvent]:
        """The reply to the user message ``text``, piece by piece; ``answered`` (or
        ``failed``) records it. stats: filled from the server's as they come. A message that
        does not fit alone is the server's refusal (ContextExceeded), the conversation as it
        was."""
        self.conversation.add("user", text)
        kept, dropped = list(self.conversation.turns), 0
        while True:
            body = self.body | {"messages": self.conversation.messages()}
            pieces = stream_remote(self.remote, body, stats, chat=True, names=self.names)
            try:
                first = next(pieces, None)
            except ContextExceeded:
                if self.conversation.drop_oldest():
                    dropped += 1
                    continue
                self.conversation.turns[:] = kept[:-1]
                raise
            try:
                if dropped:
                    self.say(f"dropped the oldest {dropped} turn{'s' * (dropped != 1)} to fit "
                             "the server's context (the system prompt stays)")  # fmt: skip
                if first is not None:
                    yield first
                    yield from pieces
            finally:
                pieces.close()  # (a reply stopped early: the server cancels it)
            return

    def answered(self, reply: str) -> None:
        """Record ``reply`` (what was shown of it) as the assistant's message."""
        self.conversation.add("assistant", reply)

    def failed(self) -> None:
        """The reply failed before any of it was shown: its user message goes."""
        if self.conversation.turns and self.conversation.turns[-1]["role"] == "user":
            self.conversation.turns.pop()
