"""core/tree_pass.py: a token tree verified in one target pass gives, at every node, the
logits of a plain pass over that node's path (float32 tolerance), for RoPE variants of
mlx-lm's own families; the kept path made contiguous continues as a plain prefix does; what
cannot take a tree is refused by name."""

import mlx.core as mx
import pytest
from families import build
from helpers import make_tiny

from specmlx.core.batch_caches import attention_rows, rows_of
from specmlx.core.caches import make_caches
from specmlx.core.tree_acceptance import Tree
from specmlx.core.tree_pass import (
    keep_path,
    keep_rows_paths,
    rows_tree_logits,
    tree_logits,
    tree_refusal,
)

PREFIX = [5, 9, 2, 7, 1, 3, 8]
TREE = Tree((0, 0, 1, 1, 2, 3))  # root -> 1, 2; 1 -> 3, 4; 2 -> 5; 3 -> 6 (depth 3)
TOKENS = [4, 11, 6, 6, 13, 2, 10]  # the root's token, then the nodes' (siblings 3 and 4 alike)

SCALINGS = {
    "default": None,
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "linear": {"rope_type": "linear", "factor": 2.0},
}  # fmt: skip


def _llama(scaling):
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=64,
        rope_theta=10000.0, rope_scaling=scaling, max_position_embeddings=64,
    )  # fmt: skip
    mx.random.seed(1)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


WINDOWED = ["llama_swa", "gemma3_text", "gpt_oss", "cohere2", "olmo3", "ministral3", "exaone4",
            "gemma4_text"]  # fmt: skip
LONG = PREFIX * 3  # 21 tokens: past the families' window of 8, so each layer's window cuts


def _plain_last(model, tokens):
    cache = make_caches(model)
    return model(mx.array([tokens]), cache=cache)[0, -1]


def _filled(model, prefix=PREFIX, steps=1):
    """Caches holding ``prefix``, fed in ``steps`` passes (several: a window's buffer moves)."""
    cache = make_caches(model)
    cut = [len(prefix) * i // steps for i in range(steps + 1)]
    for a, b in zip(cut, cut[1:], strict=False):
        model(mx.array([prefix[a:b]]), cache=cache)
    return cache


@pytest.mark.parametrize(
    "model", [*(f"llama-{s}" for s in SCALINGS), "qwen3", "qwen3_moe", *WINDOWED]
)
def test_each_node_sees_its_path(model):
    if model.startswith("llama-"):
        target, prefixes = _llama(SCALINGS[model[6:]]), [(PREFIX, 1)]
    else:  # windows: a prefix inside one window, and past it fed in one pass or in five
        target = build(model, 4 if model in WINDOWED else 2, 1)
        prefixes = [(PREFIX, 1), (LONG, 1), (LONG, 5)] if model in WINDOWED else [(PREFIX, 1)]
    for prefix, steps in prefixes:
        cache = _filled(target, prefix, steps)
        logits = tree_logits(target, cache, mx.array(TOKENS, dtype=mx.uint32), TREE)
        assert logits.shape[0] == TREE.size + 1
        for node in range(TREE.size + 1):
            path = [TOKENS[0]] + [TOKENS[j] for j in TREE.path(node)]
            want = _plain_last(target, prefix + path)
            assert mx.allclose(logits[node], want, atol=1e-4), (model, len(prefix), node)


def test_a_chain_pass_is_a_plain_pass():
    target = make_tiny(2)
    cache = _filled(target)
    chain = Tree.chain(4)
    got = tree_logits(target, cache, mx.array(TOKENS[:5], dtype=mx.uint32), chain)
    want = target(mx.array([TOKENS[:5]]), cache=_filled(target))[0]
    assert mx.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("family", ["tiny", "llama_swa", "gemma3_text"])
def test_the_kept_path_continues_as_a_prefix(family):
    """Keep root -> 1 -> 3 -> 6 of the tree: plain passes after it equal ones over the
    prefix and that path (windows: 12 more tokens, so the kept keys leave the window in
    turn); the control (the entries left in pass order) does not."""
    target = make_tiny(3) if family == "tiny" else build(family, 4, 3)
    prefix = PREFIX if family == "tiny" else LONG
    path = [0, 1, 3, 6]
    kept = [TOKENS[j] for j in path]
    after = [12, 3, 7, 1, 9, 4, 4, 2, 8, 6, 5, 10]
    want = target(mx.array([prefix + kept + after]), cache=make_caches(target))[0, -len(after) :]
    for compact in (True, False):
        cache = _filled(target, prefix)
        tree_logits(target, cache, mx.array(TOKENS, dtype=mx.uint32), TREE)
        if compact:
            keep_path(cache, len(prefix), path)
        else:  # the wrong way: keep the first len(path) entries as the pass left them
            for c in cache:
                c.offset = len(prefix) + len(path)
        got = mx.concatenate([target(mx.array([[t]]), cache=cache)[0] for t in after])
        assert mx.allclose(got, want, atol=1e-4).item() == compact, (family, compact)


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2"])
def test_recurrent_layers_are_refused_by_name(family):
    target = build(family, 2, 1)
    why = tree_refusal(target, make_caches(target))
    assert why and "ArraysCache" in why, why
    with pytest.raises(ValueError, match="tree pass"):
        tree_logits(target, make_caches(target), mx.array(TOKENS, dtype=mx.uint32), TREE)


@pytest.mark.parametrize("wrong", ["pass-order positions", "causal mask"])
def test_the_node_test_fails_without_either_seam(wrong, monkeypatch):
    """The controls: nodes at their places in the pass (P + i, not P + depth), or a causal
    mask over the pass (siblings see each other): some node's logits are not its path's."""
    import specmlx.core.tree_pass as tree_pass

    if wrong == "pass-order positions":
        monkeypatch.setattr(tree_pass, "_ropes", lambda model: [])
        monkeypatch.setattr(tree_pass, "tree_refusal", lambda model, cache: None)
    else:
        monkeypatch.setattr(tree_pass, "tree_mask", lambda tree, prefix, window=None: "causal")
    target = make_tiny(4)
    logits = tree_logits(target, _filled(target), mx.array(TOKENS, dtype=mx.uint32), TREE)
    off = [
        not mx.allclose(
            logits[node],
            _plain_last(target, PREFIX + [TOKENS[0]] + [TOKENS[j] for j in TREE.path(node)]),
            atol=1e-4,
        )
        for node in range(TREE.size + 1)
    ]
    assert any(off), wrong


def test_the_node_test_fails_when_a_window_is_not_applied(monkeypatch):
    """The control for windows: a mask that lets each node see every key its layer gets
    (the last window - 1 before the pass, then the pass) puts old keys in deep nodes' view."""
    import specmlx.core.tree_pass as tree_pass

    full = tree_pass.tree_mask
    monkeypatch.setattr(
        tree_pass, "tree_mask", lambda tree, prefix, window=None: full(tree, prefix)
    )
    target = build("gemma3_text", 4, 1)
    logits = tree_logits(target, _filled(target, LONG), mx.array(TOKENS, dtype=mx.uint32), TREE)
    off = [
        not mx.allclose(
            logits[node],
            _plain_last(target, LONG + [TOKENS[0]] + [TOKENS[j] for j in TREE.path(node)]),
            atol=1e-4,
        ).item()
        for node in range(TREE.size + 1)
    ]
    assert any(off) and not off[0], off


# a batch's rows (core.batch_caches), a tree each: row 0 the tree above after PREFIX, row 1 a smaller
# tree (padded in the pass) after a longer prefix
ROW_TREES = [TREE, Tree((0, 0, 1))]
ROW_TOKENS = [TOKENS, [9, 3, 5, 3]]


def _rows(target, prefixes):
    """Batch caches holding each of ``prefixes`` as a row (each prefilled alone)."""
    cache = None
    for prefix in prefixes:
        cache = rows_of(cache, _filled(target, prefix))
    return cache


@pytest.mark.parametrize("family", ["tiny", "llama_swa", "gemma3_text"])
def test_a_batch_of_trees_sees_each_row_its_own_paths(family):
    """Every row's nodes get the logits of a plain pass over that row's own prefix and path
    (windows: prefixes past the window of 8); after each row keeps a path, a batch pass over
    more tokens gives every row a plain pass's logits. The control (each row's entries left
    in pass order) does not."""
    target = make_tiny(3) if family == "tiny" else build(family, 4, 3)
    prefixes = [PREFIX, LONG] if family == "tiny" else [LONG, LONG + PREFIX[:4]]
    n = max(len(t) for t in ROW_TOKENS)
    x = mx.array([t + [0] * (n - len(t)) for t in ROW_TOKENS], dtype=mx.uint32)  # (2, N + 1)
    cache = _rows(target, prefixes)
    logits = rows_tree_logits(target, cache, x, ROW_TREES)
    assert logits.shape[:2] == (2, n)
    for b, (prefix, tree, tokens) in enumerate(zip(prefixes, ROW_TREES, ROW_TOKENS, strict=True)):
        for node in range(tree.size + 1):
            want = _plain_last(target, prefix + [tokens[0]] + [tokens[j] for j in tree.path(node)])
            assert mx.allclose(logits[b, node], want, atol=1e-4), (family, b, node)
    paths = [[0, 1, 3, 6], [0, 2]]
    after = [[12, 3], [7, 1]]
    for compact in (True, False):
        cache = _rows(target, prefixes)
        rows_tree_logits(target, cache, x, ROW_TREES)
        held = [len(p) for p in prefixes]
        if compact:
            keep_rows_paths(cache, held, paths)
        else:  # the wrong way: keep each row's first len(path) entries as the pass left them
            for c in attention_rows(cache):
                c.lens = [h + len(p) for h, p in zip(held, paths, strict=True)]
        got = target(mx.array(after), cache=cache)  # (2, 2, V)
        same = []
        for b, (prefix, tokens) in enumerate(zip(prefixes, ROW_TOKENS, strict=True)):
            kept = [tokens[j] for j in paths[b]]
            want = _plain_last(target, prefix + kept + after[b][:1])
            want2 = _plain_last(target, prefix + kept + after[b])
            same.append(mx.allclose(got[b, 0], want, atol=1e-4).item()
                        and mx.allclose(got[b, 1], want2, atol=1e-4).item())  # fmt: skip
        assert all(same) if compact else not all(same), (family, compact, same)


def test_a_batch_refuses_trees_over_recurrent_rows():
    target = build("qwen3_next", 2, 1)
    cache = _rows(target, [PREFIX, PREFIX[:3]])
    why = tree_refusal(target, cache)
    assert why and "BatchArraysCache" in why, why
