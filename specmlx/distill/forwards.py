"""The training forwards of the heads `specmlx distill --head eagle3|dflash|mtp` trains, each
run as its drafter runs it, with their losses and held-out estimates by depth.

EAGLE-3 (eagle3.py) is trained with EAGLE-3's training-time test: the head is unrolled
``depth`` steps over a whole row at once, step s at index i reading step s - 1's output there
and the token t_{i+1+s}, at position i + s, and attending to step 0's keys at j <= i and to
each later step's key at i alone -- exactly the keys a chained draft sees at inference (the
cache holds the fed pairs, then one entry per chained step). Step s at i predicts t_{i+2+s},
whose label is the target's distribution at position i + 1 + s; step s's loss weighs 0.8^s
(EAGLE-3's ploss_weight). Only the head's vocabulary is scored: the target ids outside it are
one more outcome, as in the student's losses.

DFlash (dflash.py) is trained on blocks anchored at random positions p of a row: the block
[t_p, MASK, ..., MASK] at positions p..p+w-1 attends to the context features c_j, j < p, and
to itself both ways (as ``DFlashHead.block`` after feeding c_0..c_{p-1}); block position i
predicts t_{p+i}, labelled by the target's distribution at p + i - 1, weighed
exp(-(i - 1) / gamma) with gamma = w / 2 (the DFlash paper's decaying weights: an early miss
ends the accepted run, so early positions matter most).

An MTP head (mtp.py) is trained for its one step, as its authors train it: the pair
(h_i, t_{i+1}) predicts t_{i+2}, labelled by the target's distribution at i + 1, over whole
rows at once (a causal pass through the head's own cache).

All read the target's features (hidden.HiddenTap) at the layers their config names. Nothing
here writes to disk or prints.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from ..drafting.heads import dflash, eagle3, mtp

STEP_DECAY = 0.8  # EAGLE-3's loss weight of unrolled step s: 0.8^s


# ---------------------------------------------------------------- EAGLE-3: the unrolled head


def eagle3_steps(head: eagle3.Eagle3Head, feats: mx.array, tokens: mx.array, depth: int):
    """The head unrolled ``depth`` steps over whole rows, as a chained draft runs it (see
    the module's docstring). feats (B, L, 3T) the target's features at positions 0..L-1;
    tokens (B, L) the row's tokens. Returns one (B, L, draft_vocab) logits array per step:
    step s at index i predicts t_{i+2+s} (meaningful for i <= L - 2 - s)."""
    layer, c = head.midlayer, head.config
    attn = layer.self_attn
    b, n, _ = feats.shape
    rep, scale = c.heads // c.kv_heads, c.head_dim**-0.5
    embed = head._held.embed if head._held.embed is not None else head.embed_tokens
    h = head.fc(feats)  # (B, L, H)
    causal = mx.arange(n)[None, :] <= mx.arange(n)[:, None]  # (L, L): key j <= query i
    keys, values, out = [], [], []
    for s in range(depth):
        # the token after each hidden state: t_{i+1+s} (0 past the row: never scored)
        shifted = mx.concatenate([tokens[:, 1 + s :], mx.zeros((b, 1 + s), tokens.dtype)], 1)
        x = mx.concatenate(
            [layer.input_layernorm(embed(shifted).astype(h.dtype)), layer.hidden_norm(h)], -1
        )  # (B, L, 2H)
        q = attn.q_proj(x).reshape(b, n, c.kv_heads, rep, c.head_dim).transpose(0, 2, 3, 1, 4)
        k = attn.k_proj(x).reshape(b, n, c.kv_heads, c.head_dim).transpose(0, 2, 1, 3)
        v = attn.v_proj(x).reshape(b, n, c.kv_heads, c.head_dim).transpose(0, 2, 1, 3)
        # step s sits at position i + s (RoPE's offset); q (B, kv, rep, L, d), k (B, kv, L, d)
        q = attn.rope(q.reshape(b, -1, n, c.head_dim), offset=s).reshape(q.shape)
        keys.append(attn.rope(k, offset=s))
        values.append(v)
        first = (q @ keys[0][:, :, None].swapaxes(-1, -2)) * scale  # (B, kv, rep, L, L)
        first = mx.where(causal, first, -mx.inf)
        # each later step's own key at the same index: (B, kv, rep, L, 1) each
        diag = [mx.sum(q * kk[:, :, None], -1, keepdims=True) * scale for kk in keys[1:]]
        w = mx.softmax(mx.concatenate([first, *diag], -1), -1, precise=True)
        o = w[..., :n] @ values[0][:, :, None]  # (B, kv, rep, L, d)
        for r, vv in enumerate(values[1:]):
            o = o + w[..., n + r : n + r + 1] * vv[:, :, None]
        o = o.reshape(b, c.heads, n, c.head_dim).transpose(0, 2, 1, 3).reshape(b, n, -1)
        h = h + attn.o_proj(o)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        out.append(head.lm_head(head.norm(h)))
    return out


def draft_columns(head: eagle3.Eagle3Head) -> mx.array:
    """(V,) int32: each target id's column of the head's logits, -1 outside its vocabulary."""
    index = head._held.to_target
    if index is None:
        return mx.arange(head.config.vocab, dtype=mx.int32)
    return mx.where(index == head.config.draft_vocab, -1, index)


def _shift(x: mx.array, s: int) -> mx.array:
    # x (B, L, ...) moved s positions earlier along axis 1, the tail repeated (never scored)
    return mx.concatenate([x[:, s:], mx.repeat(x[:, -1:], s, axis=1)], 1) if s else x


def eagle3_loss(head, loss_fn, batch: dict, depth: int) -> mx.array:
    """The unrolled head's loss on a batch: sum over steps s of 0.8^s times ``loss_fn``
    (student.kl_loss or tvd_loss) between step s and the target's top-k at position i+1+s,
    over the indices i <= L - 2 - s. batch: rows (B, L), feats (B, L, 3T), idx and logp
    (B, L, k)."""
    rows, n = batch["rows"], batch["rows"].shape[1]
    columns = draft_columns(head)
    total = mx.array(0.0)
    for s, logits in enumerate(eagle3_steps(head, batch["feats"], rows, depth)):
        cols = columns[_shift(batch["idx"], 1 + s)]  # (B, L, k) draft columns, -1 outside
        valid = (mx.arange(n) <= n - 2 - s)[None]  # (1, L)
        loss = loss_fn(logits.astype(mx.float32), mx.maximum(cols, 0),
                       _shift(batch["logp"], 1 + s), keep=cols >= 0, valid=valid)  # fmt: skip
        total = total + STEP_DECAY**s * loss
    return total


def eagle3_estimate(head, feats: mx.array, rows: mx.array, p: mx.array, depth: int) -> dict:
    """Held-out greedy agreement and alpha = E[sum min(p, q)] (T = 1) of each unrolled step
    (``greedy@s``, ``alpha@s``; step 1's also as ``greedy``/``alpha``/``kl``). feats, rows:
    held-out features and tokens; p (H, L, V) the target's probabilities there."""
    ids = mx.array(np.nonzero(np.array(draft_columns(head)) >= 0)[0])  # draft id -> target id
    n, out = rows.shape[1], {}
    for s, logits in enumerate(eagle3_steps(head, feats, rows, depth)):
        m = n - 1 - s  # indices 0..L-2-s: p at position i + 1 + s
        lq = logits[:, :m].astype(mx.float32)
        lq = lq - mx.logsumexp(lq, -1, keepdims=True)
        out.update(_agreement(p[:, 1 + s :].astype(mx.float32), lq, ids, s + 1))
    return {**out, "greedy": out["greedy@1"], "alpha": out["alpha@1"], "kl": out["kl@1"]}


def _agreement(p: mx.array, lq: mx.array, ids: mx.array, at: int) -> dict[str, float]:
    """greedy@at, alpha@at and kl@at between p (.., V) and a head's log-q (.., V_d) over the
    target ids ``ids`` (V_d,) (q = 0 elsewhere; KL over the partition {each of ids, rest})."""
    q = mx.exp(lq)
    pd = mx.take(p, ids, axis=-1)  # (.., V_d)
    agree = mx.mean(ids[mx.argmax(lq, -1)] == mx.argmax(p, -1))
    alpha = mx.mean(mx.sum(mx.minimum(pd, q), -1))
    rest = mx.maximum(1 - mx.sum(pd, -1), 0.0)
    kl = mx.sum(pd * (mx.log(mx.maximum(pd, 1e-30)) - lq), -1)
    kl = kl + rest * (
        mx.log(mx.maximum(rest, 1e-30)) - mx.log(mx.maximum(1 - mx.sum(q, -1), 1e-30))
    )
    return {
        f"greedy@{at}": agree.item(),
        f"alpha@{at}": alpha.item(),
        f"kl@{at}": mx.mean(kl).item(),
    }


# ---------------------------------------------------------------- MTP: the one step


def mtp_logits(head: mtp.MTPHead, feats: mx.array, tokens: mx.array) -> mx.array:
    """The head's step over whole rows, as a drafter feeding it the row's pairs does:
    feats (B, L, H) the target's final hidden states, tokens (B, L) the row's; the pair at i
    is (h_i, t_{i+1}) (0 past the row). Returns logits (B, L, V): index i predicts t_{i+2}."""
    b = tokens.shape[0]
    shifted = mx.concatenate([tokens[:, 1:], mx.zeros((b, 1), tokens.dtype)], 1)
    _, logits = head(feats, shifted, head.make_cache())
    return logits


def mtp_loss(head, loss_fn, batch: dict) -> mx.array:
    """The step's loss against the target's top-k at position i + 1, indices i <= L - 2."""
    n = batch["rows"].shape[1]
    logits = mtp_logits(head, batch["feats"], batch["rows"]).astype(mx.float32)
    valid = (mx.arange(n) <= n - 2)[None]
    return loss_fn(logits, _shift(batch["idx"], 1), _shift(batch["logp"], 1), valid=valid)


def mtp_estimate(head, feats: mx.array, rows: mx.array, p: mx.array) -> dict:
    """Held-out greedy agreement, alpha and KL of the step (as ``greedy@1``... and
    ``greedy``, ``alpha``, ``kl``). feats, rows: held-out features and tokens; p (H, L, V)."""
    logits = mtp_logits(head, feats, rows)[:, :-1].astype(mx.float32)
    lq = logits - mx.logsumexp(logits, -1, keepdims=True)
    out = _agreement(p[:, 1:].astype(mx.float32), lq, mx.arange(lq.shape[-1]), 1)
    return {**out, "greedy": out["greedy@1"], "alpha": out["alpha@1"], "kl": out["kl@1"]}


# ---------------------------------------------------------------- DFlash: blocks at anchors


def anchors_for(n: int, width: int, count: int, rng: np.random.Generator, b: int) -> mx.array:
    """(b, count) block starts p, 1 <= p <= L - width + 1 (each block's labels in the row),
    drawn without replacement per row where the row allows."""
    top = n - width + 1
    picks = [np.sort(rng.choice(np.arange(1, top + 1), min(count, top), replace=False))
             for _ in range(b)]  # fmt: skip
    return mx.array(np.stack(picks).astype(np.int32))


def dflash_blocks(head: dflash.DFlashHead, feats: mx.array, tokens: mx.array,
                  anchors: mx.array, width: int) -> mx.array:  # fmt: skip
    """Blocks of ``width`` drafted at every anchor of each row at once, each as
    DFlashHead.block drafts it after being fed the row's context before it (see the module's
    docstring). feats (B, L, n*H); tokens (B, L); anchors (B, m) block starts p >= 1.
    Returns logits (B, m, width - 1, V): block position i predicts t_{p+i}."""
    c, ctx = head.config, head.hidden_norm(head.fc(feats))  # the context (B, L, H)
    b, n, _ = feats.shape
    m = anchors.shape[1]
    rep, scale = c.heads // c.kv_heads, c.head_dim**-0.5
    first = mx.take_along_axis(tokens, anchors, axis=1)  # (B, m): t_p
    block = mx.concatenate(
        [first[..., None], mx.full((b, m, width - 1), c.mask_id, first.dtype)], -1
    )
    x = head._shared.embed(block.reshape(b * m, width)).astype(ctx.dtype)  # (B*m, w, H)
    starts = anchors.reshape(b * m)
    seen = (mx.arange(n)[None, None] < anchors[..., None])[:, :, None, None, None]  # j < p
    for layer in head.layers:
        attn = layer.self_attn
        kc, vc = attn._kv(ctx, 0)  # (B, kv, L, d): the context at positions 0..L-1
        xn = layer.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(xn).reshape(b * m, width, c.heads, -1)).transpose(0, 2, 1, 3)
        q = attn.rope(q, offset=starts).reshape(b, m, c.kv_heads, rep, width, c.head_dim)
        kb, vb = attn._kv(xn, starts)  # (B*m, kv, w, d): the block at p..p+w-1
        kb = kb.reshape(b, m, c.kv_heads, 1, width, c.head_dim)
        vb = vb.reshape(b, m, c.kv_heads, 1, width, c.head_dim)
        to_ctx = (q @ kc[:, None, :, None].swapaxes(-1, -2)) * scale  # (B, m, kv, rep, w, L)
        to_ctx = mx.where(seen, to_ctx, -mx.inf)
        w = mx.softmax(mx.concatenate([to_ctx, (q @ kb.swapaxes(-1, -2)) * scale], -1), -1,
                       precise=True)  # fmt: skip
        o = w[..., :n] @ vc[:, None, :, None] + w[..., n:] @ vb  # (B, m, kv, rep, w, d)
        o = o.reshape(b * m, c.heads, width, c.head_dim).transpose(0, 2, 1, 3)
        h = x + attn.o_proj(o.reshape(b * m, width, -1))
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = head._shared.head(head.norm(x[:, 1:]))  # (B*m, w-1, V)
    return logits.reshape(b, m, width - 1, -1)


def block_weights(width: int) -> mx.array:
    """(width - 1,) the loss weight of block positions 1..w-1: exp(-(i - 1) / (w / 2))."""
    return mx.exp(-mx.arange(width - 1) / (width / 2))


def _at_blocks(x: mx.array, anchors: mx.array, width: int) -> mx.array:
    # x (B, L, k) gathered at positions p + i - 1, i = 1..w-1: (B, m, w-1, k)
    pos = anchors[..., None] + mx.arange(width - 1)  # (B, m, w-1)
    b, m, w1 = pos.shape
    return mx.take_along_axis(x, pos.reshape(b, m * w1, 1), axis=1).reshape(b, m, w1, -1)


def dflash_loss(head, loss_fn, batch: dict, width: int) -> mx.array:
    """The blocks' loss on a batch: block position i weighs block_weights(width)[i - 1] times
    ``loss_fn`` against the target's top-k at p + i - 1. batch: rows, feats, idx, logp as for
    eagle3_loss, and anchors (B, m)."""
    anchors = batch["anchors"]
    logits = dflash_blocks(head, batch["feats"], batch["rows"], anchors, width)
    idx, logp = _at_blocks(batch["idx"], anchors, width), _at_blocks(batch["logp"], anchors, width)
    weights = block_weights(width)
    total = mx.array(0.0)
    for i in range(width - 1):
        loss = loss_fn(logits[:, :, i].astype(mx.float32), idx[:, :, i], logp[:, :, i])
        total = total + weights[i] * loss
    return total / mx.sum(weights)


def dflash_estimate(head, feats: mx.array, rows: mx.array, p: mx.array, width: int,
                    anchors: mx.array) -> dict:  # fmt: skip
    """Held-out greedy agreement, alpha and KL at each block position (``greedy@i``, ...;
    position 1's also as ``greedy``/``alpha``/``kl``), at fixed ``anchors``. feats, rows:
    held-out features and tokens; p (H, L, V) the target's probabilities there."""
    logits = dflash_blocks(head, feats, rows, anchors, width).astype(mx.float32)
    lq = logits - mx.logsumexp(logits, -1, keepdims=True)
    ids = mx.arange(lq.shape[-1])
    out = {}
    for i in range(width - 1):
        pi = _at_blocks(p, anchors, width)[:, :, i].astype(mx.float32)
        out.update(_agreement(pi, lq[:, :, i], ids, i + 1))
    return {**out, "greedy": out["greedy@1"], "alpha": out["alpha@1"], "kl": out["kl@1"]}


def depth_line(metrics: dict, name: str = "greedy") -> Sequence[float]:
    """The per-depth figures ``name@1``, ``name@2``, ... of an estimate, in order."""
    out, s = [], 1
    while f"{name}@{s}" in metrics:
        out.append(metrics[f"{name}@{s}"])
        s += 1
    return out
