"""Token events -> text: prompt encoding, streaming detokenization, stop strings."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .errors import BadInput
from .stats import Stats, TokenEvent


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
