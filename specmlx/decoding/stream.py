"""Token events -> text: prompt encoding, streaming detokenization, stop strings."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

from ..core.stats import Stats, TokenEvent
from ..errors import BadInput


def encode_prompt(
    tokenizer, text: str, *, chat: bool = False, system: str | None = None
) -> list[int]:
    """Token ids of ``text`` as a raw completion (right for code, BOS as the tokenizer adds
    it) or, with ``chat``, as one user message through the tokenizer's chat template, after
    ``system`` as the system message when given."""
    if not text.strip() and not chat:
        raise BadInput("the prompt is empty")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise BadInput("this tokenizer has no chat template; drop --chat")
        return chat_ids(tokenizer, chat_messages(text, system))
    return list(tokenizer.encode(text))


def chat_messages(text: str, system: str | None = None) -> list[dict]:
    """One user message, after a system message when ``system`` is given."""
    first = [{"role": "system", "content": system}] if system is not None else []
    return [*first, {"role": "user", "content": text}]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The ids of ``messages`` through the tokenizer's chat template, with the assistant's
    turn opened. Newer transformers answer a mapping (a BatchEncoding: a UserDict, not a
    dict), whose iteration is its keys, never its ids.

    tokenizer: an HF tokenizer or mlx-lm's wrapper; messages: role/content dicts."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return [int(t) for t in (ids["input_ids"] if isinstance(ids, Mapping) else ids)]


def _held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that could still begin a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class TextStream:
    """Token events -> text events, one at a time (what stream_text does, for a caller that
    pushes events as they come, such as a batch's rows): UTF-8 safe across token boundaries
    (mlx-lm's streaming detokenizer), ending at a stop string (which is not emitted).

    tokenizer: the target's; stop_strings: text that ends the generation, held back while it
    may be forming; stats: gets finish_reason "stop" at a stop string."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = (), stats: Stats | None = None):
        self.stops = [s for s in stop_strings if s]
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.stats, self.held, self.last = stats, "", None  # held: may begin a stop string
        self.stopped = False

    def add(self, ev: TokenEvent) -> TokenEvent:
        """The event with the text its token completed; ``stopped`` is set at a stop string
        (the event's text then ends before it, and nothing more comes)."""
        self.detok.add_token(ev.token)
        text = self.held + self.detok.last_segment
        hit = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            if self.stats is not None:
                self.stats.finish_reason = "stop"
            self.stopped = True
            return TokenEvent(ev.token, ev.from_draft, text[:hit])
        keep = _held_back(text, self.stops) if self.stops else 0
        self.held = text[len(text) - keep :] if keep else ""
        self.last = ev
        return TokenEvent(ev.token, ev.from_draft, text[: len(text) - keep])

    def end(self) -> TokenEvent | None:
        """The text still held when the tokens end (a last event without a token), if any."""
        if self.stopped:
            return None
        self.detok.finalize()
        tail = self.held + self.detok.last_segment
        return TokenEvent(None, self.last.from_draft, tail) if tail and self.last else None


def stream_text(
    tokenizer,
    events: Iterator[TokenEvent],
    stop_strings: Sequence[str] = (),
    stats: Stats | None = None,
) -> Iterator[TokenEvent]:
    """The text of a stream of token events (TextStream over an iterator): each event comes
    back with the text its token completed; generation ends where ``events`` end or at a
    stop string. Closing this iterator early closes ``events`` (the engine's KVState stays
    exact). tokenizer, stop_strings, stats: as for TextStream."""
    text = TextStream(tokenizer, stop_strings, stats)
    try:
        for ev in events:
            yield text.add(ev)
            if text.stopped:
                return
        tail = text.end()
        if tail is not None:
            yield tail
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()


class EditorLimits:
    """llama.cpp's limits for code completion in editors, over text events pushed one at a
    time (editor_limits does it over an iterator).

    time_limit_s (``t_max_predict_ms``): once this long has passed since the first token and
    a new line has been generated, stop; min_indent (``n_indent``): stop at a line (after
    the first) whose first non-blank character is indented less, cutting the text there.
    Either stop sets finish_reason "limit" in ``stats``. clock: seconds (for tests)."""

    def __init__(self, time_limit_s=None, min_indent=None, stats=None, clock=time.perf_counter):
        self.time_limit_s, self.min_indent, self.stats, self.clock = (
            time_limit_s, min_indent, stats, clock,
        )  # fmt: skip
        self.start, self.newline = None, False  # newline: a new line has been generated
        self.at_line_start, self.indent = False, 0
        self.stopped = False

    def add(self, ev: TokenEvent) -> TokenEvent:
        """The event as it may go out (cut at a shallower line); ``stopped`` is set when
        nothing more comes after it."""
        self.start = self.clock() if self.start is None else self.start
        text = ev.text or ""
        if self.min_indent:
            for i, ch in enumerate(text):
                if ch == "\n":
                    self.at_line_start, self.indent = True, 0
                elif self.at_line_start and ch in " \t":
                    self.indent += 1
                elif self.at_line_start:
                    self.at_line_start = False
                    if self.indent < self.min_indent:
                        self._stop()
                        return TokenEvent(ev.token, ev.from_draft, text[:i])
        self.newline = self.newline or "\n" in text
        limit = self.time_limit_s
        if limit is not None and self.newline and self.clock() - self.start > limit:
            self._stop()
        return ev

    def _stop(self) -> None:
        if self.stats is not None:
            self.stats.finish_reason = "limit"
        self.stopped = True


def editor_limits(
    events: Iterator[TokenEvent],
    time_limit_s: float | None = None,
    min_indent: int | None = None,
    stats: Stats | None = None,
    clock=time.perf_counter,
) -> Iterator[TokenEvent]:
    """EditorLimits over an iterator of text events. Closing this iterator early closes
    ``events`` (the engine's KVState stays exact). time_limit_s, min_indent, stats, clock:
    as for EditorLimits."""
    limits = EditorLimits(time_limit_s, min_indent, stats, clock)
    try:
        for ev in events:
            yield limits.add(ev)
            if limits.stopped:
                return
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
