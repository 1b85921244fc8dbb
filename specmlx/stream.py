"""Token events -> text: prompt encoding, streaming detokenization, stop strings."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.nn as nn

from .engine import generate_tokens
from .errors import BadInput
from .stats import Stats


@dataclass
class Response:
    """One generated token and the text it completed (often "", or several characters)."""

    text: str
    token: int | None  # None for the final flush of text held by the detokenizer
    from_draft: bool
    stats: Stats


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
    target: nn.Module,
    draft: nn.Module | None,
    tokenizer,
    prompt_ids: Sequence[int],
    *,
    stop_strings: Sequence[str] = (),
    stats: Stats | None = None,
    **engine_kwargs,
) -> Iterator[Response]:
    """Stream text, UTF-8 safe across token boundaries (mlx-lm's streaming detokenizer).
    Generation ends at EOS, the token budget, or a stop string (which is not emitted).

    target, draft, prompt_ids: as for engine.generate_tokens; tokenizer: the target's (its
    EOS ids end generation unless ``eos_ids`` is given); stop_strings: text that ends the
    generation, held back while it may be forming; stats: updated live; engine_kwargs: the
    rest of generate_tokens' arguments (sampling, num_draft, max_tokens, seed, kv, ...).
    Closing the iterator early closes the engine's generator (its KVState stays exact)."""
    stats = stats if stats is not None else Stats()
    engine_kwargs.setdefault("eos_ids", sorted(getattr(tokenizer, "eos_token_ids", ()) or ()))
    stops = [s for s in stop_strings if s]
    detok = tokenizer.detokenizer
    detok.reset()
    held = ""  # text withheld because it may be the start of a stop string
    events = generate_tokens(target, draft, prompt_ids, stats=stats, **engine_kwargs)
    try:
        last = None
        for ev in events:
            detok.add_token(ev.token)
            text = held + detok.last_segment
            hit = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if hit >= 0:
                stats.finish_reason = "stop"
                yield Response(text[:hit], ev.token, ev.from_draft, stats)
                return
            keep = _held_back(text, stops) if stops else 0
            held = text[len(text) - keep :] if keep else ""
            yield Response(text[: len(text) - keep], ev.token, ev.from_draft, stats)
            last = ev
        detok.finalize()
        tail = held + detok.last_segment
        if tail and last is not None:
            yield Response(tail, None, last.from_draft, stats)
    finally:
        events.close()
