"""core/tree_acceptance.py on hand-built arrays: the tree's shape, a chain equals today's
token-wise rule, greedy keeps the longest argmax path, and sampled trees (independent
siblings, a point mass among them, a grandchild) emit whole sequences with the target's
joint distribution, with the control (no residual update between siblings) rejected by the
same test."""

import mlx.core as mx
import numpy as np
import pytest
from kit_distribution import pooled_chi2

import specmlx.core.tree_acceptance as tree_acceptance
from specmlx.core.acceptance import point_mass, sampled_outcome
from specmlx.core.tree_acceptance import Tree, accept_tree, accept_tree_greedy, tree_outcome


def test_the_trees_shape():
    t = Tree((0, 0, 1, 1, 2))  # root -> 1, 2; 1 -> 3, 4; 2 -> 5
    assert t.depths() == [0, 1, 1, 2, 2, 2]
    assert t.children() == [[1, 2], [3, 4], [5], [], [], []]
    assert t.path(4) == [1, 4] and t.path(5) == [2, 5] and t.path(0) == []
    assert Tree.chain(3).parents == (0, 1, 2)
    with pytest.raises(ValueError, match="before"):
        Tree((0, 2))


def test_a_chain_is_token_wise_speculative_sampling():
    """On a chain the tree rule is today's token-wise rule, round for round: the same
    drafts kept for the same uniforms, and the same next distribution."""
    rng = np.random.default_rng(0)
    b, k, v = 2000, 3, 5
    p = rng.dirichlet(np.ones(v), size=(b, k + 1)).astype(np.float32)
    q = rng.dirichlet(np.ones(v), size=(b, k)).astype(np.float32)
    d = np.array([[rng.choice(v, p=q[i, j] / q[i, j].sum()) for j in range(k)] for i in range(b)])
    u = rng.random((b, k)).astype(np.float32)
    p, q, d, u = mx.array(p), mx.array(q), mx.array(d, dtype=mx.uint32), mx.array(u)
    n, dist = sampled_outcome(p, q, d, u)
    node, tree_dist = tree_outcome(p, q, d, Tree.chain(k), u)
    assert mx.array_equal(node, n.astype(mx.int32))
    want = dist / dist.sum(axis=-1, keepdims=True)
    assert mx.allclose(tree_dist, want, atol=1e-5)


def test_greedy_keeps_the_longest_argmax_path():
    # root's argmax 2; node 1 (token 1) is not it, node 2 (token 2) is; after node 2 the
    # argmax is 0: node 3 (token 0) is kept, node 4 (token 3, a sibling) is not; after node
    # 3 the argmax is 4, the bonus token
    tree = Tree((0, 0, 2, 2))
    logits = mx.full((5, 6), -5.0)
    logits = logits.at[0, 2].add(9).at[2, 0].add(9).at[3, 4].add(9).at[1, 5].add(9).at[4, 1].add(9)
    tokens = mx.array([1, 2, 0, 3], dtype=mx.uint32)
    node, nxt = accept_tree_greedy(logits, tokens, tree)
    assert node.item() == 3 and tree.path(3) == [2, 3] and nxt.item() == 4
    # nothing matches: no node kept, the root's argmax next
    node, nxt = accept_tree_greedy(logits, mx.array([1, 3, 0, 3], dtype=mx.uint32), tree)
    assert node.item() == 0 and nxt.item() == 2


# ------------------------------------------------------ sampled trees: whole sequences

V = 6
N_SEQ = 120_000
TREE = Tree((0, 0, 0, 1))  # the root tries 1, 2, 3 in turn; node 1 has a child, 4
POINT = 2  # node 3 is a point mass on this token (a lookup match, a top-m candidate)


def _tables(seed):
    rng = np.random.default_rng(seed)
    p_root = rng.dirichlet(np.ones(V))
    after = rng.dirichlet(np.ones(V), size=V)  # the target after a first token x: after[x]
    q1, q2 = rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    q_after = rng.dirichlet(np.ones(V), size=V)  # node 4's draft given node 1's token
    return p_root, after, q1, q2, q_after


def _sequences(seed):
    """Counts of the first two tokens of N_SEQ rounds over TREE (a round that emits one
    token gets its second from the target, as the next round would), and the exact joint."""
    p_root, after, q1, q2, q_after = _tables(seed)
    rng = np.random.default_rng(seed + 1)
    t1 = rng.choice(V, size=N_SEQ, p=q1)
    t2 = rng.choice(V, size=N_SEQ, p=q2)  # independent of node 1's
    t3 = np.full(N_SEQ, POINT)
    t4 = np.array([rng.choice(V, p=q_after[x]) for x in t1])
    tokens = np.stack([t1, t2, t3, t4], axis=1)
    q = np.stack([np.tile(q1, (N_SEQ, 1)), np.tile(q2, (N_SEQ, 1)),
                  np.eye(V)[t3], q_after[t1]], axis=1)  # fmt: skip
    p = np.stack([np.tile(p_root, (N_SEQ, 1)), after[t1], after[t2], after[t3],
                  np.tile(p_root, (N_SEQ, 1))], axis=1)  # fmt: skip
    # (node 4's p is what follows root -> 1 -> 4: after two tokens; any fixed table row
    # will do for a first-two-tokens test, and p_root is one)
    u = rng.random((N_SEQ, 4))
    node, nxt = accept_tree(
        mx.array(p, dtype=mx.float32), mx.array(q, dtype=mx.float32),
        mx.array(tokens, dtype=mx.uint32), TREE, mx.array(u, dtype=mx.float32),
        mx.random.key(seed),
    )  # fmt: skip
    node, nxt = np.array(node), np.array(nxt)
    counts = np.zeros(V * V)
    paths = {n: TREE.path(n) for n in range(TREE.size + 1)}
    for i in range(N_SEQ):
        emitted = [int(tokens[i, j - 1]) for j in paths[int(node[i])]] + [int(nxt[i])]
        if len(emitted) == 1:
            emitted.append(int(rng.choice(V, p=after[emitted[0]])))
        counts[emitted[0] * V + emitted[1]] += 1
    return counts, (p_root[:, None] * after).reshape(-1), node


def test_sampled_trees_follow_the_target_joint():
    counts, joint, node = _sequences(3)
    assert pooled_chi2(counts, joint) > 1e-3
    kept = np.bincount(node, minlength=TREE.size + 1)
    assert all(kept > 0.01 * len(node)), kept  # every path ran: none, each child, node 4


def test_the_tree_test_rejects_no_residual_update_between_siblings(monkeypatch):
    monkeypatch.setattr(tree_acceptance, "_residual", lambda r, q: r)
    counts, joint, _ = _sequences(3)
    assert pooled_chi2(counts, joint) < 1e-6


def test_a_point_mass_row_is_what_lookup_proposes():
    """point_mass rows are what the tree rule reads for a point mass: acceptance r(t), and a
    rejection removes t from r."""
    p = mx.array([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    tokens = mx.array([1], dtype=mx.uint32)
    q = point_mass(tokens, 3)
    node, dist = tree_outcome(p, q, tokens, Tree((0,)), mx.array([0.4]))  # 0.4 >= 0.3
    assert node.item() == 0 and mx.allclose(dist, mx.array([0.5 / 0.7, 0.0, 0.2 / 0.7]))
    node, dist = tree_outcome(p, q, tokens, Tree((0,)), mx.array([0.2]))
    assert node.item() == 1 and mx.allclose(dist, p[1])
