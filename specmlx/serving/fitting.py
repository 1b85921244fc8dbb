"""Editors' requests fitted to the context as llama-server fits them, where the OpenAI routes
refuse a prompt that does not fit (a 400 context_length_exceeded).

/infill: a request whose prompt and room for the answer fit is left whole; one that does not
is cut as llama-server's format_prompt_infill cuts every request: the prefix's last 3/4 of a
window of N_BATCH tokens, the suffix's first 1/4 (the text typed on the cursor's line,
llama.cpp's `prompt`, counted in it), and the tail of the other files (input_extra) in what
the context has left after the window and room for the answer. That share is the server's,
the same for every request, so the other files' tail, which comes first, stays put as the
cursor moves and the prompt cache keeps serving it. /completion (llama-server's prompt
truncation): the first n_keep tokens, then whole blocks of half what is left dropped from
the front. Tokens are counted, not characters; ``Fit.truncated`` says whether anything was
cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..decoding.fim import FimTemplate, infill_pieces
from ..decoding.stream import encode_prompt

N_BATCH = 2048  # llama-server's default --batch-size: its window of text around the cursor
FIM_MARKS = 4  # the tokens an infill prompt adds to its texts: BOS, PRE, SUF, MID
# no tokenizer averages more characters a token than this over a whole prompt (code and prose
# run at 3-5; long runs of spaces at most 16 or so): text past what this many characters a
# token can hold is dropped (or, on the OpenAI routes, refused) before any tokenizing, so a
# huge request costs no more than one that fits
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Fit:
    """A prompt's token ids as fitted, and whether anything was cut to fit."""

    ids: list[int]
    truncated: bool


def answer_room(context: int, max_tokens: int) -> int:
    """Tokens an editor's prompt leaves free for the answer: the server's default budget (its
    -n), at most a quarter of the context. It is the server's figure, not the request's (as
    llama-server takes its own n_predict), so a warm-up (n_predict 0) lays out the other files
    as the suggestion after it does, which then finds them in the prompt cache.

    context: the server's context in tokens; max_tokens: its default budget."""
    return max(1, min(max_tokens, context // 4))


def infill_window(context: int, room: int) -> tuple[int, int]:
    """(window, extra): the tokens an infill prompt keeps around the cursor (prefix, suffix
    and the cursor line's typed text) and of the other files.

    context: the server's context; room: from answer_room. The window is llama-server's
    batch, less what the context needs for the answer and the FIM marks; the other files
    get llama-server's share (the context less the window and twice the answer's room), and
    never so much that the prompt and the room would pass the context."""
    window = max(4, min(N_BATCH, context - room - FIM_MARKS))
    extra = max(0, min(context - window - 2 * room, context - window - room - FIM_MARKS))
    return window, extra


def fit_infill(
    tokenizer,
    template: FimTemplate,
    prefix: str,
    suffix: str,
    *,
    extra: Sequence[tuple[str, str]] = (),
    middle: str = "",
    context: int,
    room: int,
) -> Fit:
    """An /infill prompt, whole when it fits ``context`` with ``room`` tokens left for the
    answer, else cut as llama-server cuts it (the module).

    tokenizer, template, prefix, suffix, extra, middle: as fim.encode_infill takes them;
    context: the server's context in tokens; room: from answer_room. The prefix and the
    other files keep their end, the suffix its start, the typed text its end, at most a
    quarter of the window (llama-server never cuts it, and overruns its window instead)."""
    window, extra_take = infill_window(context, room)
    quarter = window // 4
    chars = MAX_CHARS_PER_TOKEN
    sizes = len(prefix) + len(suffix) + len(middle) + sum(len(f) + 1 + len(t) for f, t in extra)
    # past this many characters it cannot fit whole: what lies beyond what the cuts below
    # keep is dropped before tokenizing, so a huge request costs no more than one that fits
    huge = sizes > context * chars
    if huge:
        prefix = prefix[len(prefix) - min(len(prefix), 3 * quarter * chars) :]
        suffix = suffix[: quarter * chars]
        middle = middle[len(middle) - min(len(middle), quarter * chars) :]
        extra = _tail_records(extra, extra_take * chars)
    p = infill_pieces(tokenizer, template, prefix, suffix, extra=extra, middle=middle)
    if not huge and len(p.ids()) + room <= context:
        return Fit(p.ids(), False)
    middle_ids = _last(p.middle, quarter)
    kept = replace(
        p,
        extra=_last(p.extra, extra_take),
        prefix=_last(p.prefix, 3 * quarter),
        suffix=p.suffix[: max(0, quarter - 2 - len(middle_ids))],
        middle=middle_ids,
    )
    return Fit(kept.ids(), True)


def fit_completion(ids: list[int], context: int, room: int, n_keep: int, bos: int | None) -> Fit:
    """A /completion prompt cut as llama-server cut one too long for its context: its first
    ``n_keep`` tokens, then the rest less whole blocks of half what the context has left
    after them, from the front.

    ids: the prompt's token ids; context: the server's context; room: tokens to leave for the
    answer (answer_room); n_keep: tokens kept from the start (-1: all that can be; a BOS the
    prompt starts with is always kept); bos: the tokenizer's BOS id, or None."""
    limit = context - room
    if len(ids) <= limit:
        return Fit(ids, False)
    keep = len(ids) if n_keep < 0 else n_keep
    if bos is not None and ids[:1] == [bos]:
        keep = max(keep, 1)
    keep = max(0, min(keep, limit - 4))
    block = (limit - keep) // 2
    erased = (len(ids) - keep - block) // block
    return Fit(ids[:keep] + ids[keep + erased * block :], True)


def completion_ids(tokenizer, text: str, context: int, n_keep: int) -> tuple[list[int], bool]:
    """(token ids, cut) of a /completion text prompt, whose text past what the context could
    hold (MAX_CHARS_PER_TOKEN a token) is cut before tokenizing: its start (beyond what
    ``n_keep`` asks kept) before its end.

    tokenizer: the target's; text: the prompt; context: the server's context; n_keep: as
    fit_completion takes it."""
    limit = context * MAX_CHARS_PER_TOKEN
    if len(text) <= limit:
        return encode_prompt(tokenizer, text), False
    tail = text[-limit:]
    if n_keep == 0:
        return encode_prompt(tokenizer, tail), True
    head = encode_prompt(tokenizer, text[:limit])[: context if n_keep < 0 else n_keep]
    return head + list(tokenizer.encode(tail, add_special_tokens=False)), True


def _last(ids: list[int], n: int) -> list[int]:
    return ids[len(ids) - min(len(ids), n) :]


def _tail_records(records: Sequence[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    """The last ``n`` characters of the other files' records (filename, text): whole records
    from the end, then the end of one."""
    kept: list[tuple[str, str]] = []
    left = n
    for filename, text in reversed(records):
        size = len(filename) + 1 + len(text)
        if size > left:
            if left > len(filename) + 1:
                kept.append((filename, text[len(text) - (left - len(filename) - 1) :]))
            break
        kept.append((filename, text))
        left -= size
    return kept[::-1]
