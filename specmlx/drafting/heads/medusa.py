"""Medusa heads (Cai et al. 2024, FasterDecoding/Medusa): loading them and the sparse token
tree they draft.

Layout, from Medusa's ``medusa/model/medusa_model.py``: K heads, each

    head_k(h) = W_k · ResBlock^L(h),     ResBlock(x) = x + SiLU(A x + b)

with A (H, H), b (H,) and W_k (V, H) (no bias); Medusa builds the L blocks of a head as
``[ResBlock(H)] * L``, one module repeated, so its published heads share one block per head;
the state_dict still lists it under every index (``k.0.linear.*``, ``k.1.linear.*``...), and
this module keeps each index's own copy. h is the base model's last hidden state, the output
of its final norm (what its LM head reads; ``self.base_model.model(...)[0]`` there).

Positions: the LM head at position t predicts the token at t + 1; head k at position t
predicts the token at t + 2 + k. In a round, the token the target last produced (the tree's
root, confirmed) came from position t's LM head; the heads read the same h_t, so head 0 gives
the root's children, head k the nodes at depth k + 1.

Files: ``medusa_lm_head.safetensors`` (Medusa's training script) or ``medusa_lm_head.pt``
(the published heads: ``torch.save`` of the heads' ModuleList state_dict; tensors
``{k}.{j}.linear.weight``, ``{k}.{j}.linear.bias`` for the blocks j < L and ``{k}.{L}.weight``
for the output layer). A ``.pt`` is read without torch (torch_zip.py) and without running its pickle's
code: only the few names a state_dict uses are let through. The head and layer counts come
from the tensor names, not from a config (the published configs misstate the head count;
Medusa itself hard-codes 5 when it loads them).

The tree: Medusa's ``medusa_choices`` list paths of ranks; a path (r_1, ..., r_d) is the node
whose token is head d-1's rank-r_d token, under the node (r_1, ..., r_{d-1}). Medusa sorts
them by (length, ranks) (``generate_medusa_buffers``), which puts parents first and siblings
in rank order, and maps each node to ``top-k(head d-1)[r_d]`` (``generate_candidates``);
``medusa_tree`` does the same into specmlx's parents form (core.tree_acceptance.Tree).
"""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...errors import BadInput
from .torch_zip import one_line, read_torch_zip

FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")  # a directory's, in this order

# The first 16 of Medusa's mc_sim_7b_63 (medusa/model/medusa_choices.py, the tree its
# generate() falls back on), in the order listed there: the order its greedy search added
# nodes by estimated acceptance, so every prefix of one of these is among them. 16 nodes, up
# to depth 3 (three heads), against the full list's 63 nodes and depth 4.
SMALL_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2),
    (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5), (0, 0, 1), (5,),
)  # fmt: skip


class MedusaHeads(nn.Module):
    """K Medusa heads over one hidden state, all heads' matrices stacked so that each layer
    is one batched matmul rather than K.

    hidden: H, the base model's hidden size; vocab: V, its vocabulary (the heads' output);
    heads: K, the number of heads; layers: L, the residual blocks in each head (0 allowed:
    the head is then its output layer alone).

    Fresh weights: blocks at zero, so each is an identity (Medusa's ResBlock zeroes its
    weight, leaving torch's random bias), and output layers uniform in ±1/sqrt(H), nn.Linear's
    default; load_medusa replaces them all."""

    def __init__(self, hidden: int, vocab: int, heads: int, layers: int = 1):
        super().__init__()
        self.hidden, self.vocab, self.heads, self.layers = hidden, vocab, heads, layers
        # (L, K, H, H): block j of head k's A, stored (out, in) as torch's Linear stores it
        self.res_weight = mx.zeros((layers, heads, hidden, hidden))
        self.res_bias = mx.zeros((layers, heads, hidden))  # (L, K, H)
        bound = hidden**-0.5
        self.out_weight = mx.random.uniform(-bound, bound, (heads, vocab, hidden))  # (K, V, H)

    def __call__(self, h: mx.array) -> mx.array:
        """Every head's logits: h (..., H), the base model's final-norm hidden states ->
        (..., K, V); [..., k, :] at position t scores the token at t + 2 + k."""
        # (..., K, 1, H): each head gets its own copy of h as a row vector, so a block is
        # one matmul against (K, H, H) broadcast over the leading axes
        x = mx.broadcast_to(h[..., None, :], (*h.shape[:-1], self.heads, self.hidden))
        x = x[..., None, :]
        for j in range(self.layers):
            # (..., K, 1, H) @ (K, H, H) -> (..., K, 1, H): A x + b for every head at once
            y = x @ self.res_weight[j].swapaxes(-1, -2) + self.res_bias[j][:, None, :]
            x = x + nn.silu(y)
        # (..., K, 1, H) @ (K, H, V) -> (..., K, 1, V), then drop the row axis
        return (x @ self.out_weight.swapaxes(-1, -2))[..., 0, :]


# ----------------------------------------------------------------------------- loading

# a head's tensor names: block j's linear (weight or bias), or the output layer at index L
_NAME = re.compile(r"(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)")


def load_medusa(path: str | Path) -> MedusaHeads:
    """Medusa heads from a directory (``medusa_lm_head.safetensors``, else
    ``medusa_lm_head.pt``) or from one such file (``.safetensors``; ``.pt``, ``.pth`` or
    ``.bin`` for a torch zip checkpoint). The weights keep the file's dtype.

    path: the directory or file. BadInput, one line naming the file and what is wrong, where
    none is there or it is damaged, foreign, or not a Medusa heads' state_dict."""
    file = _find(Path(path))
    tensors = _read_safetensors(file) if file.suffix == ".safetensors" else read_torch_zip(file)
    return _build(tensors, file)


def heads_file(path: str | Path) -> Path:
    """The heads' file at ``path`` (a directory holding one of FILES, or the file itself);
    BadInput where there is none."""
    return _find(Path(path))


def _find(path: Path) -> Path:
    """The heads' file at path (a directory holding one of FILES, or the file itself)."""
    if path.is_dir():
        for name in FILES:
            if (path / name).is_file():
                return path / name
        raise BadInput(f"{path} holds no Medusa heads (looked for {' or '.join(FILES)})")
    if not path.is_file():
        raise BadInput(f"{path}: no such file or directory")
    if path.suffix not in (".safetensors", ".pt", ".pth", ".bin"):
        raise BadInput(f"{path}: not a Medusa heads file (.safetensors or a torch .pt)")
    return path


def _read_safetensors(file: Path) -> dict[str, mx.array]:
    """A safetensors file's tensors (MLX reads bfloat16 natively)."""
    try:
        return dict(mx.load(str(file), format="safetensors"))
    except Exception as e:  # MLX says RuntimeError or ValueError, by the damage
        raise BadInput(f"{file}: not a readable safetensors file ({one_line(e)})") from None


def _build(tensors: dict[str, mx.array], file: Path) -> MedusaHeads:
    """The heads from their state_dict, the counts read from the names and the sizes from
    the shapes, every tensor checked against them first."""
    if not tensors:
        raise BadInput(f"{file} holds no tensors")
    parts: dict[int, dict[int, dict[str, mx.array]]] = collections.defaultdict(dict)
    for name, t in sorted(tensors.items()):  # sorted: the same name reported whatever the order
        m = _NAME.fullmatch(name)
        if m is None:
            raise BadInput(
                f"{file}: tensor {name!r} is not a Medusa head's (they are named like "
                "0.0.linear.weight, 0.0.linear.bias, 0.1.weight)"
            )
        if not mx.issubdtype(t.dtype, mx.floating):
            raise BadInput(f"{file}: tensor {name!r} is {t.dtype}, not floating point")
        parts[int(m[1])].setdefault(int(m[2]), {})[m[3]] = t
    heads = len(parts)
    if sorted(parts) != list(range(heads)):
        raise BadInput(f"{file}: the heads are numbered {sorted(parts)}, not 0..{heads - 1}")
    layers = -1  # head 0 sets it
    for k in range(heads):
        outs = [j for j, p in parts[k].items() if "weight" in p]
        if len(outs) != 1:
            raise BadInput(f"{file}: head {k} has {len(outs)} output layers ({k}.N.weight), not 1")
        n = outs[0]  # the output layer's index is the number of blocks before it
        blocks = {j: p for j, p in parts[k].items() if j != n}
        if sorted(blocks) != list(range(n)) or any(
            set(p) != {"linear.weight", "linear.bias"} for p in blocks.values()
        ):
            raise BadInput(
                f"{file}: head {k}'s blocks are not {k}.0..{k}.{n - 1} each with "
                "linear.weight and linear.bias before its output layer"
            )
        if k and n != layers:
            raise BadInput(f"{file}: head {k} has {n} blocks, head 0 has {layers}")
        layers = n
    vocab, hidden = _shape(parts[0][layers]["weight"], 2, file, f"0.{layers}.weight")
    for k in range(heads):
        _expect(parts[k][layers]["weight"], (vocab, hidden), file, f"{k}.{layers}.weight")
        for j in range(layers):
            _expect(parts[k][j]["linear.weight"], (hidden, hidden), file, f"{k}.{j}.linear.weight")
            _expect(parts[k][j]["linear.bias"], (hidden,), file, f"{k}.{j}.linear.bias")
    model = MedusaHeads(hidden, vocab, heads, layers)
    # stacked as MedusaHeads keeps them: (L, K, H, H), (L, K, H), (K, V, H); with L = 0
    # the fresh (0, K, ...) arrays stay
    if layers:
        model.res_weight = mx.stack(
            [mx.stack([parts[k][j]["linear.weight"] for k in range(heads)]) for j in range(layers)]
        )
        model.res_bias = mx.stack(
            [mx.stack([parts[k][j]["linear.bias"] for k in range(heads)]) for j in range(layers)]
        )
    model.out_weight = mx.stack([parts[k][layers]["weight"] for k in range(heads)])
    mx.eval(model.parameters())
    return model


def _shape(t: mx.array, ndim: int, file: Path, name: str) -> tuple[int, ...]:
    """t's shape, BadInput unless it has ndim axes."""
    if t.ndim != ndim:
        raise BadInput(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, not {ndim}-D")
    return tuple(t.shape)


def _expect(t: mx.array, shape: tuple[int, ...], file: Path, name: str) -> None:
    """BadInput unless t has the shape the other tensors imply."""
    if tuple(t.shape) != shape:
        raise BadInput(f"{file}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")


# ------------------------------------------------------------------------------ tree


def _sorted_choices(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """choices as tuples in Medusa's order (length, then ranks), BadInput where one is
    empty, negative, repeated or lacks its parent (Medusa's own lookup would fail there)."""
    paths = [tuple(int(r) for r in c) for c in choices]
    seen = set(paths)
    if len(seen) != len(paths):
        raise BadInput("Medusa choices repeat a path")
    for p in paths:
        if not p or min(p) < 0:
            raise BadInput(f"Medusa choice {list(p)} is not a non-empty path of ranks >= 0")
        if len(p) > 1 and p[:-1] not in seen:
            raise BadInput(f"Medusa choice {list(p)} has no parent {list(p[:-1])} in the list")
    return sorted(paths, key=lambda p: (len(p), p))


def ranks_needed(choices: Sequence[Sequence[int]]) -> list[int]:
    """How many of each head's top tokens a tree uses: [d] = 1 + the largest rank at depth
    d + 1 (its length: the heads the tree reaches).

    choices: Medusa's paths of ranks."""
    need: list[int] = []
    for p in _sorted_choices(choices):
        if len(p) > len(need):
            need.append(0)
        need[len(p) - 1] = max(need[len(p) - 1], p[-1] + 1)
    return need


def medusa_top(logits: mx.array, choices: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each head's top tokens, best first, as many as ``choices`` use (torch.topk's order).

    logits: (K, V), the heads' logits at one position (MedusaHeads' output there); choices:
    Medusa's paths of ranks (BadInput where they reach deeper than K heads)."""
    need = ranks_needed(choices)
    if len(need) > logits.shape[0]:
        raise BadInput(f"Medusa choices reach depth {len(need)}, past the {logits.shape[0]} heads")
    out = []
    for k, n in enumerate(need):
        row = logits[k]  # (V,)
        # the n best in any order (a partition, not a sort of all V), then sorted by value
        idx = mx.argpartition(-row, kth=n - 1)[:n] if n < row.shape[0] else mx.arange(row.shape[0])
        idx = idx[mx.argsort(-row[idx])]
        out.append(idx.tolist())
    return out


def medusa_tree(
    top: list[list[int]], choices: Sequence[Sequence[int]]
) -> tuple[list[int], tuple[int, ...]]:
    """The sparse tree Medusa drafts, as (tokens, parents): node i (1..N) holds tokens[i - 1]
    under node parents[i - 1] (0 the root, the last confirmed token), the form
    ``core.tree_acceptance.Tree(parents)`` takes; nodes in Medusa's order (by depth, then
    ranks), so parents come first and siblings follow their rank, the order they are tried.

    top: top[k][r] is head k's rank-r token (medusa_top); choices: Medusa's paths of ranks
    (e.g. SMALL_CHOICES, or its mc_sim_7b_63), any order. BadInput where the choices are
    malformed or reach past the heads; ValueError where top lacks a rank they use or repeats
    a token within a head (siblings must differ)."""
    paths = _sorted_choices(choices)
    index = {p: i + 1 for i, p in enumerate(paths)}  # path -> node number (the root is 0)
    depth = max((len(p) for p in paths), default=0)
    if depth > len(top):
        raise BadInput(f"Medusa choices reach depth {depth}, past the {len(top)} heads")
    for k, n in enumerate(ranks_needed(paths)):
        used = top[k][:n]
        if len(used) < n:
            raise ValueError(f"head {k} gave {len(used)} top tokens; the tree uses {n}")
        if len(set(used)) != n:
            raise ValueError(f"head {k}'s top tokens repeat one: {used}")
    tokens = [int(top[len(p) - 1][p[-1]]) for p in paths]
    parents = tuple(index[p[:-1]] if len(p) > 1 else 0 for p in paths)
    return tokens, parents


KIND = "medusa"  # --draft medusa:PATH|ALIAS


class MedusaDraft(nn.Module):
    """Medusa heads as a draft over the target's hidden states: they read its final hidden
    state ("final": the output of its final norm) and draft a sparse tree each round
    (trees.rows.MedusaRows), never a chain of their own. Nothing is fed to them between
    rounds: they keep no cache (``make_cache`` is empty, a call feeds nothing).

    heads: the loaded MedusaHeads; choices: the tree they draft at most (Medusa's paths)."""

    reads_hidden = ("final",)

    def __init__(self, heads: MedusaHeads, choices: Sequence[Sequence[int]] = SMALL_CHOICES):
        super().__init__()
        _sorted_choices(choices)  # (BadInput where they are malformed)
        self.heads = heads
        self.choices = tuple(tuple(c) for c in choices)  # (their order: which go first)

    def make_cache(self) -> list:
        return []

    def __call__(self, hidden: mx.array, tokens: mx.array | None, cache: list):
        """The heads read no context: feeding them is a no-op (the engine's prefill feeds
        every head over the hidden states its pairs)."""
        return None, None


def check_fit(width: int, vocab: int, config: dict, where: str) -> None:
    """BadInput where heads ``width`` wide over ``vocab`` ids do not fit a target of
    ``config`` (its config.json): another hidden size, or more ids than its logits.

    where: the heads, as the message names them."""
    text = config.get("text_config", {})
    hidden = config.get("hidden_size") or text.get("hidden_size")
    if hidden is not None and width != hidden:
        raise BadInput(
            f"Medusa heads in {where} read width {width}, the target's hidden size is {hidden}"
        )
    ids = config.get("vocab_size") or text.get("vocab_size")
    if ids is not None and vocab > ids:
        raise BadInput(f"Medusa heads in {where} propose {vocab} ids, past the target's {ids}")


def peek_shape(file: Path) -> tuple[int, int] | None:
    """(width, vocab) of the heads in a safetensors ``file`` from its header alone (None for
    a torch .pt, or where no output layer is named as Medusa names it)."""
    if file.suffix != ".safetensors":
        return None
    try:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None  # (the load says what is wrong with it)
    for name, meta in header.items():
        m = _NAME.fullmatch(name)
        if (
            m
            and m.group(3) == "weight"
            and isinstance(meta, dict)
            and len(meta.get("shape", ())) == 2
        ):
            vocab, width = meta["shape"]
            return width, vocab
    return None


def load_medusa_over(target: nn.Module, config: dict, path: str | Path) -> MedusaDraft:
    """Medusa heads from ``path`` as a draft over ``target``: BadInput where their width is
    not the target's hidden size or their vocabulary is wider than its logits.

    target: the loaded target; config: its config.json (hidden_size, vocab_size); path: the
    heads' file or directory."""
    heads = load_medusa(path)
    check_fit(heads.hidden, heads.vocab, config, str(path))
    return MedusaDraft(heads)


def tree_shape(choices: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], list[tuple[int, int]]]:
    """A Medusa tree's shape, known before any token: its parents (as medusa_tree gives them)
    and, per node, the (head, rank) whose top token it holds."""
    paths = _sorted_choices(choices)
    width = max((p[-1] for p in paths), default=0) + 1
    depth = max((len(p) for p in paths), default=0)
    symbolic = [[k * width + r for r in range(width)] for k in range(depth)]
    ids, parents = medusa_tree(symbolic, paths)
    return parents, [divmod(i, width) for i in ids]
