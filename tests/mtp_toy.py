"""A tiny target with a trained MTP head, for plumbing tests and the toy MTP benchmark
(experiments/mtp_toy.py): a Qwen3.5-shaped target trained on a toy language whose next token
depends on the two before it, then a head trained on the frozen target's hidden states and
greedy labels, as MTP heads are trained. Mechanics only: no claim about real checkpoints."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from families import build
from mlx.utils import tree_flatten, tree_unflatten

from specmlx.core.hidden import HiddenTap
from specmlx.drafting.heads.mtp import MTPHead

SYMBOLS = 12  # the toy language's alphabet: ids 0..11 of the tiny model's 128


def toy_language(n: int, length: int, seed: int) -> mx.array:
    """n sequences where t_{i+1} = TABLE[t_{i-1}, t_i] (a fixed random table): the token
    after next depends on the token before, which only the hidden state carries."""
    table = np.random.default_rng(0).integers(0, SYMBOLS, (SYMBOLS, SYMBOLS))
    x = np.zeros((n, length), dtype=np.int64)
    x[:, :2] = np.random.default_rng(seed).integers(0, SYMBOLS, (n, 2))
    for i in range(2, length):
        x[:, i] = table[x[:, i - 2], x[:, i - 1]]
    return mx.array(x)


def _fit(model, loss, batches, steps: int) -> None:
    opt, step = optim.Adam(learning_rate=1e-2), nn.value_and_grad(model, loss)
    for i in range(steps):
        _, grads = step(model, *batches(i))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)


# trained weights, kept for the life of the test process: test_mtp and test_batch both
# train the same target and head (about 40 s), and each caller gets fresh modules
_TRAINED: dict[tuple, list] = {}


def _trained(model: nn.Module, key: tuple, train) -> nn.Module:
    """``model`` with the weights ``train(model)`` gives it, trained once a process for
    ``key`` and loaded from then on."""
    if key in _TRAINED:
        model.update(tree_unflatten(_TRAINED[key]))
    else:
        train(model)
        _TRAINED[key] = tree_flatten(model.parameters())
    mx.eval(model.parameters())
    return model


def toy_target(steps: int = 300) -> nn.Module:
    """The tiny Qwen3.5 trained on the toy language (next-token loss from t_2 on)."""

    def lm_loss(m, x):
        return nn.losses.cross_entropy(m(x[:, :-1])[:, 1:], x[:, 2:]).mean()

    def train(target):
        _fit(target, lm_loss, lambda i: (toy_language(32, 24, i),), steps)

    return _trained(build("qwen3_5", 2, 0), ("target", steps), train)


def toy_head(target: nn.Module, steps: int = 300) -> MTPHead:
    """An MTP head for ``target`` (untrained with steps = 0): pair j, (h_j, t_{j+1}), learns
    the target's greedy choice at j + 1."""
    tap = HiddenTap(target)

    def batch(i):
        x = toy_language(32, 24, 10**6 + i)
        with tap:
            labels = mx.argmax(target(x), -1)
        return tap.final()[:, :-1], x[:, 1:], labels[:, 1:]

    def loss(m, h, x, y):
        return nn.losses.cross_entropy(m(h, x, [None])[1], y).mean()

    mx.random.seed(0)
    head = MTPHead(target, "qwen3_5")
    mx.eval(head.parameters())
    # (the head learns from this target: keyed by its weights as well as the steps)
    seen = float(mx.sum(target.model.embed_tokens.weight))
    return _trained(head, ("head", steps, seen), lambda h: _fit(h, loss, batch, steps))
