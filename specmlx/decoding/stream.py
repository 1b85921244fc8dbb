"""Token events -> text: prompt encoding, streaming detokenization, stop strings."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

from ..core.stats import Stats, TokenEvent
from ..errors import BadInput


def encode_prompt(tokenizer, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text`` as a raw completion (right for code, BOS as the tokenizer adds
    it) or, with ``chat``, as one user message through the tokenizer's chat template."""
    if not text.strip() and not chat:
        raise BadInput("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise BadInput("this tokenizer has no chat template; drop --chat")
        messages = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer.encode(text))


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that could still begin a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def stream_text(
    tokenizer,
    events: Iterator[TokenEvent],
    stop_strings: Sequence[str] = (),
    stats: Stats | None = None,
) -> Iterator[TokenEvent]:
    """The text of a stream of token events, UTF-8 safe across token boundaries (mlx-lm's
    streaming detokenizer): each event comes back with the text its token completed.
    Generation ends where ``events`` end or at a stop string (which is not emitted).

    tokenizer: the target's (its detokenizer); events: the engine's token events;
    stop_strings: text that ends the generation, held back while it may be forming; stats:
    gets finish_reason "stop" at a stop string. Closing this iterator early closes
    ``events`` (the engine's KVState stays exact)."""
    stops = [s for s in stop_strings if s]
    detok = tokenizer.detokenizer
    detok.reset()
    held = ""  # text withheld because it may be the start of a stop string
    try:
        last = None
        for ev in events:
            detok.add_token(ev.token)
            text = held + detok.last_segment
            hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if hit >= 0:
                if stats is not None:
                    stats.finish_reason = "stop"
                yield TokenEvent(ev.token, ev.from_draft, text[:hit])
                return
            keep = _held_back(text, stops) if stops else 0
            held = text[len(text) - keep :] if keep else ""
            yield TokenEvent(ev.token, ev.from_draft, text[: len(text) - keep])
            last = ev
        detok.finalize()
        tail = held + detok.last_segment
        if tail and last is not None:
            yield TokenEvent(None, last.from_draft, tail)
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


def editor_limits(
    events: Iterator[TokenEvent],
    time_limit_s: float | None = None,
    min_indent: int | None = None,
    stats: Stats | None = None,
    clock=time.perf_counter,
) -> Iterator[TokenEvent]:
    """llama.cpp's limits for code completion in editors, over text events.

    time_limit_s (``t_max_predict_ms``): once this long has passed since the first token and
    a new line has been generated, stop; min_indent (``n_indent``): stop at a line (after
    the first) whose first non-blank character is indented less, cutting the text there.
    Either stop sets finish_reason "limit" in ``stats``. clock: seconds (for tests).
    Closing this iterator early closes ``events`` (the engine's KVState stays exact)."""
    start = None
    newline = False  # a new line has been generated
    at_line_start, indent = False, 0
    try:
        for ev in events:
            start = clock() if start is None else start
            text = ev.text or ""
            if min_indent:
                for i, ch in enumerate(text):
                    if ch == "\n":
                        at_line_start, indent = True, 0
                    elif at_line_start and ch in " \t":
                        indent += 1
                    elif at_line_start:
                        at_line_start = False
                        if indent < min_indent:
                            if stats is not None:
                                stats.finish_reason = "limit"
                            yield TokenEvent(ev.token, ev.from_draft, text[:i])
                            return
            yield ev
            newline = newline or "\n" in text
            if time_limit_s is not None and newline and clock() - start > time_limit_s:
                if stats is not None:
                    stats.finish_reason = "limit"
                return
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
