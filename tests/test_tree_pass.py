"""core/tree_pass.py: a token tree verified in one target pass gives, at every node, the
logits of a plain pass over that node's path (float32 tolerance), for RoPE variants of
mlx-lm's own families; the kept path made contiguous continues as a plain prefix does; what
cannot take a tree is refused by name."""

import mlx.core as mx
import pytest
from families import build
from helpers import make_tiny

from specmlx.core.caches import make_caches
from specmlx.core.tree_acceptance import Tree
from specmlx.core.tree_pass import keep_path, tree_logits, tree_refusal

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


def _plain_last(model, tokens):
    cache = make_caches(model)
    return model(mx.array([tokens]), cache=cache)[0, -1]


def _filled(model):
    cache = make_caches(model)
    model(mx.array([PREFIX]), cache=cache)
    return cache


@pytest.mark.parametrize("model", [*(f"llama-{s}" for s in SCALINGS), "qwen3", "qwen3_moe"])
def test_each_node_sees_its_path(model):
    target = _llama(SCALINGS[model[6:]]) if model.startswith("llama") else build(model, 2, 1)
    cache = _filled(target)
    logits = tree_logits(target, cache, mx.array(TOKENS, dtype=mx.uint32), TREE)
    assert logits.shape[0] == TREE.size + 1
    for node in range(TREE.size + 1):
        path = [TOKENS[0]] + [TOKENS[j] for j in TREE.path(node)]
        want = _plain_last(target, PREFIX + path)
        assert mx.allclose(logits[node], want, atol=1e-4), (model, node)


def test_a_chain_pass_is_a_plain_pass():
    target = make_tiny(2)
    cache = _filled(target)
    chain = Tree.chain(4)
    got = tree_logits(target, cache, mx.array(TOKENS[:5], dtype=mx.uint32), chain)
    want = target(mx.array([TOKENS[:5]]), cache=_filled(target))[0]
    assert mx.allclose(got, want, atol=1e-5)


def test_the_kept_path_continues_as_a_prefix():
    """Keep root -> 1 -> 3 -> 6 of the tree: a plain pass after it equals one over the
    prefix and that path; the control (the entries left in pass order) does not."""
    target = make_tiny(3)
    path = [0, 1, 3, 6]
    kept = [TOKENS[j] for j in path]
    want = _plain_last(target, PREFIX + kept + [12])
    for compact in (True, False):
        cache = _filled(target)
        tree_logits(target, cache, mx.array(TOKENS, dtype=mx.uint32), TREE)
        if compact:
            keep_path(cache, len(PREFIX), path)
        else:  # the wrong way: keep the first len(path) entries as the pass left them
            for c in cache:
                c.offset = len(PREFIX) + len(path)
        got = target(mx.array([[12]]), cache=cache)[0, -1]
        assert mx.allclose(got, want, atol=1e-4) == compact


@pytest.mark.parametrize("family", ["llama_swa", "gemma3_text", "qwen3_next", "mamba2"])
def test_windows_and_recurrent_layers_are_refused_by_name(family):
    target = build(family, 2, 1)
    why = tree_refusal(target, make_caches(target))
    assert why and ("WindowKVCache" in why or "ArraysCache" in why or "Rotating" in why), why
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
        monkeypatch.setattr(tree_pass, "tree_mask", lambda tree, prefix: "causal")
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
