"""serving/fitting.py: an editor's request fitted to the context as llama-server fits it
(format_prompt_infill's 3:1 window around the cursor and the tail of the other files;
/completion's first n_keep tokens and whole blocks dropped), counted in tokens."""

from __future__ import annotations

import random

import pytest
from helpers import tiny_tokenizer

from specmlx.decoding.fim import encode_infill, fim_template, infill_pieces
from specmlx.serving.fitting import (
    MAX_CHARS_PER_TOKEN,
    answer_room,
    completion_ids,
    fit_completion,
    fit_infill,
    infill_window,
)

LINE = "    total = total + values[index] * weight  # {}\n"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer(fim=True)


def lines(n: int, start: int = 0) -> str:
    return "".join(LINE.format(i) for i in range(start, start + n))


def test_the_window_and_the_other_files_share_as_llama_server_shares_them():
    # a 32K context with the default room: llama-server's n_batch (2048) around the cursor,
    # its n_ctx - n_batch - 2 * n_predict for the other files
    assert infill_window(32768, 256) == (2048, 32768 - 2048 - 2 * 256)
    # a 2048 context: the window is what the answer and the FIM marks leave, and no other
    # files at all (llama-server, whose window is its whole batch, takes none there either)
    assert infill_window(2048, 256) == (2048 - 256 - 4, 0)
    assert answer_room(2048, 256) == 256 and answer_room(512, 256) == 128


@pytest.mark.parametrize("context", [3000, 2400])
def test_an_infill_past_the_context_keeps_llama_servers_tokens(tok, context):
    """The prefix's last 3/4 of the window, the suffix's first 1/4 less the typed text and
    two marks, the other files' last tokens: exactly the slices of the whole request's
    tokens, whether it was tokenized whole (3000) or, past what the context could hold at
    MAX_CHARS_PER_TOKEN, cut by characters first (2400: those lay beyond the slices)."""
    t = fim_template(tok)
    room = 100
    window, extra_take = infill_window(context, room)
    assert extra_take > 0  # (this context leaves the other files a share)
    prefix, suffix, middle = lines(400), lines(300, 1000), "    result = "
    extra = [(f"f{i}.py", lines(80, 100 * i)) for i in range(12)]
    chars = len(prefix) + len(suffix) + sum(len(f) + 1 + len(x) for f, x in extra)
    assert (chars > context * MAX_CHARS_PER_TOKEN) == (context == 2400)
    fit = fit_infill(tok, t, prefix, suffix, extra=extra, middle=middle, context=context, room=room)
    whole = infill_pieces(tok, t, prefix, suffix, extra=extra, middle=middle)
    q = window // 4
    want = (
        whole.head + whole.extra[-extra_take:] + [t.prefix] + whole.prefix[-3 * q :]
        + [t.suffix] + whole.suffix[: q - 2 - len(whole.middle)] + [t.middle] + whole.middle
    )  # fmt: skip
    assert fit.ids == want and fit.truncated
    assert len(fit.ids) + room <= context


def test_a_request_that_fits_is_left_whole(tok):
    t = fim_template(tok)
    extra = [("util.py", lines(3))]
    fit = fit_infill(
        tok, t, lines(5), lines(2), extra=extra, middle="    x", context=2048, room=256
    )
    assert fit.ids == encode_infill(tok, t, lines(5), lines(2), extra=extra, middle="    x")
    assert not fit.truncated


def test_a_warm_up_lays_out_the_other_files_as_the_suggestion_after_it(tok):
    """llama.vim's warm-up (the other files alone, n_predict 0) and its next suggestion
    take the same tail of the other files, so the suggestion finds them in the prompt
    cache: the share is the server's, whatever the request's budget or cursor."""
    t = fim_template(tok)
    extra = [(f"f{i}.py", lines(60, 100 * i)) for i in range(16)]
    warm = fit_infill(tok, t, "", "", extra=extra, context=3000, room=100)
    real = fit_infill(tok, t, lines(300), lines(80, 900), extra=extra, middle="    y",
                      context=3000, room=100)  # fmt: skip
    shared = warm.ids[:-3]  # (less its PRE, SUF, MID)
    assert len(shared) > 500 and real.ids[: len(shared)] == shared


@pytest.mark.parametrize("seed", range(6))
def test_every_fitted_infill_leaves_the_room(tok, seed):
    rng = random.Random(seed)
    t = fim_template(tok)
    for _ in range(8):
        context = rng.choice([256, 512, 2048, 2400, 4096])
        room = answer_room(context, rng.choice([16, 128, 256, 1024]))
        extra = [(f"f{i}", lines(rng.randrange(0, 60), i)) for i in range(rng.randrange(0, 12))]
        prefix, suffix = lines(rng.randrange(0, 300)), lines(rng.randrange(0, 200))
        middle = "x" * rng.choice([0, 5, 3000])
        fit = fit_infill(tok, t, prefix, suffix, extra=extra, middle=middle, context=context,
                         room=room)  # fmt: skip
        assert len(fit.ids) + room <= context
        whole = encode_infill(tok, t, prefix, suffix, extra=extra, middle=middle)
        assert fit.truncated == (fit.ids != whole)


def test_a_completion_past_the_context_drops_whole_blocks_as_llama_server_did():
    """llama-server's truncation: n_keep tokens, then the rest less whole blocks of half
    what the context has left after them (here the context less the answer's room)."""
    ids = list(range(3, 1003))
    fit = fit_completion(ids, 512, 128, 0, bos=None)  # 384 for the prompt: blocks of 192
    assert fit.truncated and fit.ids == ids[4 * 192 :]
    kept = fit_completion([1, *ids], 512, 128, 0, bos=1)  # a BOS it starts with stays
    assert kept.ids[0] == 1 and len(kept.ids) < 384
    head = fit_completion(ids, 512, 128, 10, bos=None)  # n_keep: its first tokens stay
    assert head.ids[:10] == ids[:10] and len(head.ids) < 384
    assert fit_completion(ids[:300], 512, 128, 0, bos=None).ids == ids[:300]  # fits: whole
    assert not fit_completion(ids[:384], 512, 128, 0, bos=None).truncated
    assert len(fit_completion(ids, 512, 128, -1, bos=None).ids) < 384


def test_a_huge_completion_text_is_cut_before_it_is_tokenized(tok):
    text = "the cat sat on a mat. " * 3000
    ids, cut = completion_ids(tok, text, 64, 0)
    assert cut and len(ids) <= 64 * MAX_CHARS_PER_TOKEN
    assert completion_ids(tok, "def f():\n", 64, 0) == (list(tok.encode("def f():\n")), False)
