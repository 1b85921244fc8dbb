"""DFlash block drafters (z-lab, arXiv 2602.06036) in the layout their authors publish.

Layout and forward from z-lab/dflash's ``dflash/model.py`` (``DFlashDraftModel``, the code
the ``z-lab/*-DFlash*`` checkpoints load with) and its ``model_mlx.py``: a few Qwen3-style
decoder layers with no embedding and no LM head of their own (the target's are used). A
round drafts a whole block in one forward, not a chain:

    c_j = hidden_norm(fc(f_j))          # f_j: target layers' outputs at position j, side by
                                        # side (B, S, n*H) -> (B, S, H): the context
    x   = embed([t_p, MASK, ..., MASK])  # the block at positions p..p+w-1, t_p the newest
    per layer: x = x + attn(input_layernorm(x), c); x = x + mlp(post_attention_layernorm(x))
      attn: queries from the block only; keys and values from [c_0..c_{p-1}; block], with
      q_norm/k_norm on each head and RoPE at each key's own position; no mask at all: every
      block position sees the whole context and the whole block (non-causal)
    p(t_{p+i}) from the target's LM head on norm(x_i), i = 1..w-1

The context's keys and values depend on c_j alone (the layers never change c), so each
layer's cache holds them for j < p and grows only with confirmed positions; the block's own
keys are never cached (model_mlx.py's choice; the torch reference caches and crops them,
which is the same). f_j is the outputs of decoder layers ``dflash_config.target_layer_ids``
(Hugging Face's hidden_states[id + 1]; by default spread evenly from layer 1 to L - 3, as
``build_target_layer_ids`` picks them).

The draft tokens at a block's positions are drawn independently, each from its own q (the
forward reads mask tokens, not earlier drafts), which is all the acceptance rules need. A
block narrower than the checkpoint's ``block_size`` (adaptive k, or the budget's end) is run
as such, as model_mlx.py does at the budget's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ...errors import BadInput, IncompatiblePair, ModelLoadError
from .files import (
    check_architecture,
    check_layer_kind,
    head_weights,
    layer_shape,
    read_head_config,
    target_dtype,
    text_config,
)
from .targetparts import TargetParts

KIND = "dflash"


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter's shape, read from its config.json and checked against its target's.

    hidden: its width (the target's); layers: its decoder layers; heads, kv_heads, head_dim:
    its attention's; bias: its projections have biases; intermediate: its MLP's; eps: its
    RMSNorms'; rope_theta, rope_scaling, max_positions: its RoPE's; vocab: the target's
    vocabulary; block_size: the block it was trained on (at most block_size - 1 drafts a
    round); mask_id: the token that fills the block; target_layers: the target layers whose
    outputs make the context, low to high."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    bias: bool
    intermediate: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_positions: int
    vocab: int
    block_size: int
    mask_id: int
    target_layers: tuple[int, ...]


def default_layers(target_layers: int, draft_layers: int) -> list[int]:
    """The reference's ``build_target_layer_ids``: one layer, the middle; more, spread evenly
    from layer 1 to L - 3."""
    if draft_layers == 1:
        return [target_layers // 2]
    span = target_layers - 4
    return [int(round(1 + i * span / (draft_layers - 1))) for i in range(draft_layers)]


def head_config(config: dict, target_config: dict, where) -> DFlashConfig:
    """The drafter's shape from its config.json, refused in one line where it does not fit
    the target whose config.json is ``target_config`` (IncompatiblePair: another width,
    vocabulary or depth, layers past the target's depth) or is not a DFlash drafter, or asks
    what is not built (BadInput: sliding-window layers, another activation). Runs before
    either model loads.

    config: the drafter's config.json; target_config: the target's; where: names it."""
    check_architecture(
        config, "dflash", where, "a DFlash drafter", "DFlash drafters say DFlashDraftModel"
    )
    t = text_config(target_config)
    try:
        shape = layer_shape(config)
        depth, t_hidden = int(t["num_hidden_layers"]), int(t["hidden_size"])
        layers = int(config["num_hidden_layers"])
        own_depth = int(config.get("num_target_layers") or depth)
        dflash = config.get("dflash_config") or {}
        c = DFlashConfig(
            **shape,
            layers=layers,
            bias=bool(config.get("attention_bias", False)),
            vocab=int(config["vocab_size"]),
            block_size=int(config["block_size"]),
            mask_id=int(dflash["mask_token_id"]),
            target_layers=tuple(
                dflash.get("target_layer_ids") or default_layers(own_depth, layers)
            ),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: its config.json lacks or garbles {e}") from None
    check_layer_kind(config, where, "DFlash layers")
    if "sliding_attention" in (config.get("layer_types") or []):
        raise BadInput(
            f"{where} has sliding-window layers, which specmlx's DFlash does not run yet"
        )
    if c.hidden != t_hidden:
        raise IncompatiblePair(
            f"{where} is {c.hidden} wide; the target's hidden states are {t_hidden}"
        )
    if c.vocab != int(t.get("vocab_size", c.vocab)):
        raise IncompatiblePair(
            f"{where} drafts over {c.vocab} ids; the target's vocabulary has {t['vocab_size']}"
        )
    if own_depth != depth:
        raise IncompatiblePair(
            f"{where} was made for a target of {own_depth} layers; this one has {depth}"
        )
    if (
        not c.target_layers
        or len(set(c.target_layers)) != len(c.target_layers)
        or not all(isinstance(i, int) and 0 <= i < depth for i in c.target_layers)
    ):
        raise IncompatiblePair(
            f"{where} reads target layers {list(c.target_layers)}; the target has {depth} "
            "(a DFlash drafter reads different ones)"
        )
    if not 0 <= c.mask_id < c.vocab or c.block_size < 2:
        raise BadInput(f"{where}: mask token {c.mask_id} or block size {c.block_size} is unusable")
    return c


def cache_bytes(c: DFlashConfig, context: int) -> int:
    """The most its context cache holds at ``context`` tokens (float32 at most)."""
    return c.layers * 2 * c.kv_heads * c.head_dim * context * 4


class _Attention(nn.Module):
    """Queries from the block, keys and values from the cached context and the block."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.scale = c.heads, c.kv_heads, c.head_dim**-0.5
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=c.bias)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.bias)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.bias)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=c.bias)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.eps)
        # the reference's rotate_half RoPE is MLX's non-traditional one
        self.rope = initialize_rope(
            c.head_dim, c.rope_theta, False, c.rope_scaling, c.max_positions
        )

    def _kv(self, x: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    def feed(self, ctx: mx.array, cache: KVCache) -> None:
        """Append the context c (B, S, H) at positions cache.offset.. to the cache."""
        cache.update_and_fetch(*self._kv(ctx, cache.offset))

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        """x (B, w, H): the block, at the positions right after what the cache holds."""
        b, n, _ = x.shape
        at = cache.offset
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.heads, -1)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset=at)
        k, v = self._kv(x, at)
        if at:  # (B, kv_heads, at + w, head_dim): the context, then the block
            held_k, held_v = cache.keys[..., :at, :], cache.values[..., :at, :]
            k, v = mx.concatenate([held_k, k], axis=2), mx.concatenate([held_v, v], axis=2)
        o = scaled_dot_product_attention(q, k, v, cache=None, scale=self.scale, mask=None)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _Layer(nn.Module):
    """The reference's ``Qwen3DFlashDecoderLayer``: the context enters its attention as it
    is (hidden_norm'd once, never input_layernorm'd)."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.mlp = MLP(c.hidden, c.intermediate)  # mlx-lm's SwiGLU, the same names

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashHead(nn.Module):
    """A DFlash drafter over a target (see the module's docstring for the math).

    target: the mlx-lm model whose hidden states, embedding and LM head it uses; config: its
    shape (head_config). Weights are random until ``load_weights``."""

    def __init__(self, target: nn.Module, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layers) * config.hidden, config.hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden, eps=config.eps)
        self.layers = [_Layer(config) for _ in range(config.layers)]
        self.norm = nn.RMSNorm(config.hidden, eps=config.eps)
        self._shared = TargetParts.of(target)

    @property
    def reads_hidden(self) -> tuple[int, ...]:
        """Where hidden.HiddenTap reads the target for this drafter."""
        return self.config.target_layers

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def __call__(self, hidden: mx.array, tokens: mx.array | None, cache: list) -> None:
        """Feed the context: hidden (B, S, n*H), the target's features at the positions
        right after what the cache holds. ``tokens`` is not read (a context entry reads only
        its features); it is there because the engine feeds every head its pairs alike."""
        c = self.hidden_norm(self.fc(hidden))  # (B, S, H)
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            layer.self_attn.feed(c, layer_cache)

    def block(self, hidden: mx.array | None, first: mx.array, width: int, cache: list) -> mx.array:
        """Feed ``hidden`` (B, S, n*H) (None: nothing new) as context, then draft a block of
        ``width`` positions after it: first (B,) the newest token, at the block's first
        position. Returns logits (B, width - 1, V) for the width - 1 positions after it."""
        if hidden is not None:
            self(hidden, None, cache)
        b = first.shape[0]
        mask = mx.full((b, width - 1), self.config.mask_id, dtype=mx.uint32)
        x = self._shared.embed(mx.concatenate([first.astype(mx.uint32)[:, None], mask], axis=1))
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer(x, layer_cache)
        return self._shared.head(self.norm(x[:, 1:]))

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]


def load_dflash(model: nn.Module, target_config: dict, path: Path) -> DFlashHead:
    """The DFlash drafter in ``path`` over ``model`` (its loaded target), in the target's
    dtype.

    model: the target as mlx-lm loaded it; target_config: its config.json; path: the
    drafter's directory (config.json and safetensors as published). ModelLoadError when its
    tensors do not fit its config."""
    config = head_config(read_head_config(path, "a DFlash drafter"), target_config, path)
    head = DFlashHead(model, config)
    try:
        head.load_weights(list(head_weights(path).items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"the DFlash drafter in {path} does not fit its config: {e}") from None
    head.set_dtype(target_dtype(model))
    mx.eval(head.parameters())
    return head
