"""Cursors and the recording seams: nothing is patched for the whole process.

The target's recurrent mixers are recorded (recurrent.PassRecorder) and its hidden states
read (hidden.HiddenTap) by giving those instances, of that one model, a recording class for
the length of a block. Another model in the same process -- a server's second model, or a
draft of the same family -- must run mlx-lm's code untouched meanwhile, and two generations
interleaved on one thread must each give what they give alone."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from families import build, noisy_copy
from helpers import generate
from mlx_lm.models import gated_delta, qwen3_next

from specmlx.core.caches import make_caches, recurrent_layers, snapshot
from specmlx.core.cursor import Cursor
from specmlx.core.hidden import HiddenTap
from specmlx.core.recurrent import PassRecorder
from specmlx.decoding.engine import KVState

PROMPT = list(range(1, 30))


def _classes(model: nn.Module) -> dict[str, type]:
    return {name: type(m) for name, m in model.named_modules()}


def test_recording_one_model_leaves_another_and_the_library_alone():
    a, b = build("qwen3_next", 2, 0), build("qwen3_next", 2, 1)
    a_cache, b_cache = make_caches(a), make_caches(b)
    recorder = PassRecorder(a, recurrent_layers(a_cache))
    assert recorder.supported
    conv_call, update = nn.Conv1d.__call__, qwen3_next.gated_delta_update
    a_own, b_own = _classes(a), _classes(b)
    x = mx.array([PROMPT[:5]], dtype=mx.uint32)
    with recorder.recording(5):
        # inside the block: the library and the other model are as mlx-lm made them
        assert nn.Conv1d.__call__ is conv_call
        assert qwen3_next.gated_delta_update is update is gated_delta.gated_delta_update
        assert _classes(b) == b_own
        assert _classes(a) != a_own  # (this model's mixers record: the check can fail)
        b(x, cache=b_cache)
        assert recorder.convs == [] and recorder.calls == []  # b's pass recorded nothing
        a(x, cache=a_cache)
    assert len(recorder.convs) == len(recorder.calls) == len(recurrent_layers(a_cache))
    assert _classes(a) == a_own  # given back at the block's end
    b(x, cache=b_cache)  # and a later pass outside records nothing
    assert len(recorder.calls) == len(recurrent_layers(a_cache))


def test_the_recording_recomputes_the_state_a_prefix_leaves():
    """settle(m) after a recorded 5-token pass = the state a 2-token pass leaves."""
    model = build("qwen3_next", 2, 0)
    cache, fresh = make_caches(model), make_caches(model)
    recorder = PassRecorder(model, recurrent_layers(cache))
    before = snapshot(cache, 0)
    with recorder.recording(5):
        model(mx.array([PROMPT[:5]], dtype=mx.uint32), cache=cache)
    assert recorder.settle(2, before.recurrent)
    model(mx.array([PROMPT[:2]], dtype=mx.uint32), cache=fresh)
    for got, want in zip(recurrent_layers(cache), recurrent_layers(fresh), strict=True):
        for x, y in zip(got.cache, want.cache, strict=True):
            assert mx.allclose(x, y, atol=1e-5).item()


def test_a_tap_reads_one_model_for_one_block():
    a, b = build("llama", 2, 0), build("llama", 2, 1)
    tap = HiddenTap(a)
    b_own, a_own = _classes(b), _classes(a)
    x = mx.array([PROMPT[:4]])
    with tap:
        assert _classes(b) == b_own
        b(x)
        assert tap.last == [None]  # the other model's pass is not read
        a(x)
    final = tap.final()
    assert final.shape == (1, 4, a.args.hidden_size)
    assert _classes(a) == a_own
    a(mx.array([PROMPT[:2]]))  # outside the block: not read
    assert tap.final() is final


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_two_generations_interleaved_on_one_thread_match_their_solo_runs(family):
    """A speculative generation on a recorded recurrent target, its draft of the same family,
    and a plain generation of a second model of the family, stepped in turn."""
    target, draft = build(family, 2, 0, 2.0), noisy_copy(family, 2, 0, 0.05, 2.0)
    other = build(family, 2, 3, 2.0)

    def run(model, drafter, k):
        return generate(model, drafter, PROMPT, k=k, max_tokens=20)

    solo = [[e.token for e in run(target, draft, 3)], [e.token for e in run(other, None, 0)]]
    together: list[list[int]] = [[], []]
    gens = [run(target, draft, 3), run(other, None, 0)]
    live = [0, 1]
    while live:
        for i in list(live):
            event = next(gens[i], None)
            if event is None:
                live.remove(i)
            else:
                together[i].append(event.token)
    assert together == solo


def test_a_cursor_gives_back_a_queued_pass_with_its_token():
    model = build("qwen3_5", 2, 0)
    kv = KVState(target=make_caches(model))
    cursor = Cursor(model, kv.target, 0, record=True)
    logits = cursor.verify(PROMPT[0], mx.array(PROMPT[1:4], dtype=mx.uint32))
    assert logits.shape[0] == 4 and cursor.held == 4
    cursor.give_back(2, PROMPT)
    cursor.queue(mx.array([PROMPT[2]], dtype=mx.uint32))
    assert cursor.held == 3 and cursor.queued is not None
    cursor.give_back(2, PROMPT)  # the queued token goes: so does its pass
    assert cursor.queued is None and cursor.held == 2
    fresh = make_caches(model)
    model(mx.array([PROMPT[:2]], dtype=mx.uint32), cache=fresh)
    for got, want in zip(recurrent_layers(kv.target), recurrent_layers(fresh), strict=True):
        for x, y in zip(got.cache, want.cache, strict=True):
            assert mx.allclose(x, y, atol=1e-5).item()
