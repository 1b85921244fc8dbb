"""EAGLE-3 heads (Li et al. 2025, arXiv 2503.01840) in the layout their authors publish.

Layout and forward from SafeAILab/EAGLE's ``eagle/model/cnets.py`` (``Model`` with its
``LlamaDecoderLayeremb``), which SpecForge's ``llama3_eagle.py`` writes too (it adds
``head_dim`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``). One step, for the pair
(f_i, t_{i+1}) at position i:

    h   = fc(f_i) if f_i is 3 target layers wide else f_i      # (B, L, 3T) -> (B, L, H)
    x   = [input_layernorm(embed(t_{i+1})); hidden_norm(h)]     # (B, L, 2H): the 2H-wide
    h'  = h + attn(x); g = h' + mlp(post_attention_layernorm(h'))  # attention input
    p(t_{i+2}) from lm_head(norm(g)), over the draft vocabulary

f_i is the target's three hidden states at position i concatenated, low to high: the
outputs of decoder layers (1, L/2 - 1, L - 4) by default (EAGLE's ``modeling_llama_kv``
keeps the inputs of layers 2, L/2 and L - 3; SpecForge's defaults are the same layers, named
by output), or the ids a config lists. A chained step feeds g back (pre-norm, as the
reference's ``topK_genrate`` does), which is H wide and so skips fc. The head's cache
position of a pair is i, the position of its hidden state, as for an MTP head.

The draft vocabulary may be smaller than the target's (``draft_vocab_size``): draft id d is
target id d + d2t[d], and t2d marks the target ids the head can propose. The head's logits
are handed out over the target's ids with -inf elsewhere, so the distribution it samples
from has q = 0 outside its vocabulary and the acceptance rule's residual covers those ids.
The embedding is the checkpoint's ``embed_tokens`` where it ships one (SpecForge's do), else
the target's (EAGLE's ``load_emb``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ...core.hidden import text_model
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

KIND = "eagle3"


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's shape, read from its config.json and checked against its target's.

    hidden: the head's width H; heads, kv_heads, head_dim: its attention's; intermediate:
    its MLP's; eps: its RMSNorms'; rope_theta, rope_scaling, max_positions: its RoPE's;
    vocab: the target's vocabulary (what d2t maps into); draft_vocab: the head's own;
    target_hidden: the width of each of the target's hidden states; layers: the target
    layers whose outputs are concatenated, low to high."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_positions: int
    vocab: int
    draft_vocab: int
    target_hidden: int
    layers: tuple[int, ...]


def head_config(config: dict, target_config: dict, where) -> Eagle3Config:
    """The head's shape from its config.json, refused in one line (IncompatiblePair) where it
    does not fit the target whose config.json is ``target_config``: another hidden size or
    vocabulary, or layers past the target's depth; BadInput where it is not an EAGLE-3 head.
    Runs before either model loads.

    config: the head's config.json; target_config: the target's; where: names the head."""
    check_architecture(
        config, "eagle3", where, "an EAGLE-3 head", "EAGLE-3 heads say LlamaForCausalLMEagle3"
    )
    t = text_config(target_config)
    try:
        shape = layer_shape(config)
        depth, t_hidden = int(t["num_hidden_layers"]), int(t["hidden_size"])
        vocab = int(config["vocab_size"])
        c = Eagle3Config(
            **shape,
            vocab=vocab,
            draft_vocab=int(config.get("draft_vocab_size") or vocab),
            target_hidden=int(config.get("target_hidden_size") or shape["hidden"]),
            layers=tuple(
                (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                or (1, depth // 2 - 1, depth - 4)
            ),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{where}: its config.json lacks or garbles {e}") from None
    check_layer_kind(config, where, "EAGLE-3 heads")
    if c.target_hidden != t_hidden:
        raise IncompatiblePair(
            f"{where} reads hidden states {c.target_hidden} wide; the target's are {t_hidden}"
        )
    if c.vocab != int(t.get("vocab_size", c.vocab)):
        raise IncompatiblePair(
            f"{where} maps into {c.vocab} ids; the target's vocabulary has {t['vocab_size']}"
        )
    if (
        len(c.layers) != 3
        or len(set(c.layers)) != 3
        or not all(isinstance(i, int) and 0 <= i < depth for i in c.layers)
    ):
        raise IncompatiblePair(
            f"{where} reads target layers {list(c.layers)}; the target has {depth} "
            "(an EAGLE-3 head reads three different ones)"
        )
    return c


def check_embedding(c: Eagle3Config, names: set[str], target_config: dict, where) -> None:
    """A head that ships no ``embed_tokens`` embeds with the target's: only when the widths
    agree (IncompatiblePair otherwise). names: the head's tensor names."""
    t_hidden = int(text_config(target_config)["hidden_size"])
    if "embed_tokens.weight" not in names and c.hidden != t_hidden:
        raise IncompatiblePair(
            f"{where} is {c.hidden} wide and ships no embed_tokens; the target's embedding "
            f"is {t_hidden} wide"
        )


class _Attention(nn.Module):
    """The midlayer's attention: queries, keys and values from the 2H-wide [emb; hidden]."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.heads, self.kv_heads, self.scale = c.heads, c.kv_heads, c.head_dim**-0.5
        self.q_proj = nn.Linear(2 * c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        # the reference's rotate_half RoPE is MLX's non-traditional one
        self.rope = initialize_rope(
            c.head_dim, c.rope_theta, False, c.rope_scaling, c.max_positions
        )

    def __call__(self, x: mx.array, mask, cache: KVCache) -> mx.array:
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _MidLayer(nn.Module):
    """The reference's ``LlamaDecoderLayeremb``: the residual is the hidden state, not x."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.hidden_norm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.input_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.mlp = MLP(c.hidden, c.intermediate)  # mlx-lm's SwiGLU, the same names

    def __call__(self, emb: mx.array, h: mx.array, mask, cache: KVCache) -> mx.array:
        x = mx.concatenate([self.input_layernorm(emb), self.hidden_norm(h)], axis=-1)
        h = h + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class _Held:
    """What the head uses but does not own as parameters: the target's embedding (when the
    checkpoint ships none) and the draft -> target id map, held by reference."""

    def __init__(self, embed: nn.Module | None, to_target: mx.array | None):
        self.embed, self.to_target = embed, to_target


class Eagle3Head(nn.Module):
    """An EAGLE-3 head over a target (see the module's docstring for the math).

    target: the mlx-lm model whose hidden states (and, without an own embedding, embedding)
    the head reads; config: its shape (head_config); own_embedding: the checkpoint ships
    ``embed_tokens``. Weights are random until ``load_weights``; the d2t map is set by
    ``map_vocabulary``."""

    def __init__(self, target: nn.Module, config: Eagle3Config, own_embedding: bool = False):
        super().__init__()
        self.config = config
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.fc = nn.Linear(3 * config.target_hidden, config.hidden, bias=False)
        self.midlayer = _MidLayer(config)
        self.norm = nn.RMSNorm(config.hidden, eps=config.eps)
        self.lm_head = nn.Linear(config.hidden, config.draft_vocab, bias=False)
        self._held = _Held(None if own_embedding else text_model(target).embed_tokens, None)

    @property
    def reads_hidden(self) -> tuple[int, ...]:
        """Where hidden.HiddenTap reads the target for this head: three layers' outputs."""
        return self.config.layers

    def map_vocabulary(self, d2t: mx.array | None) -> None:
        """Draft id d proposes target id d + d2t[d] (d2t (draft_vocab,) ints; None: the two
        vocabularies are one)."""
        c = self.config
        if d2t is not None and c.draft_vocab == c.vocab and not mx.any(d2t).item():
            d2t = None  # an identity map (a head over the whole vocabulary): no gather needed
        if d2t is None:
            if c.draft_vocab != c.vocab:
                raise ModelLoadError("a head with its own vocabulary needs its d2t map")
            self._held.to_target = None
            return
        ids = mx.arange(c.draft_vocab) + d2t.astype(mx.int32)  # (draft_vocab,) target ids
        # the target id -> the draft column it reads; draft_vocab is an added -inf column
        index = mx.full((c.vocab,), c.draft_vocab, dtype=mx.int32)
        index[ids] = mx.arange(c.draft_vocab, dtype=mx.int32)
        self._held.to_target = index

    def __call__(
        self, hidden: mx.array, tokens: mx.array, cache: list
    ) -> tuple[mx.array, mx.array]:
        """hidden (B, L, 3T) the target's features, or (B, L, H) a previous step's output, at
        positions i..i+L-1; tokens (B, L): the tokens at i+1..i+L; cache: [KVCache] holding i
        pairs. Returns (g (B, L, H), logits (B, L, vocab) over the target's ids)."""
        if hidden.shape[-1] != self.config.hidden:
            hidden = self.fc(hidden)
        embed = self._held.embed if self._held.embed is not None else self.embed_tokens
        e = embed(tokens).astype(hidden.dtype)
        g = self.midlayer(e, hidden, create_attention_mask(hidden, cache[0]), cache[0])
        logits = self.lm_head(self.norm(g))  # (B, L, draft_vocab)
        index = self._held.to_target
        if index is not None:
            pad = mx.full((*logits.shape[:-1], 1), -mx.inf, dtype=logits.dtype)
            logits = mx.take(mx.concatenate([logits, pad], axis=-1), index, axis=-1)
        return g, logits

    def make_cache(self) -> list:
        return [KVCache()]


def load_eagle3(model: nn.Module, target_config: dict, path: Path) -> Eagle3Head:
    """The EAGLE-3 head in ``path`` over ``model`` (its loaded target), in the target's dtype.

    model: the target as mlx-lm loaded it; target_config: its config.json; path: the head's
    directory (config.json and safetensors as published). ModelLoadError when its tensors do
    not fit its config."""
    config = head_config(read_head_config(path, "an EAGLE-3 head"), target_config, path)
    weights = head_weights(path)
    check_embedding(config, set(weights), target_config, path)
    weights.pop("t2d", None)  # the inverse of d2t, which says everything it does
    d2t = weights.pop("d2t", None)
    head = Eagle3Head(model, config, own_embedding="embed_tokens.weight" in weights)
    try:
        head.load_weights(list(weights.items()), strict=True)
        head.map_vocabulary(d2t)
    except ValueError as e:
        raise ModelLoadError(f"the EAGLE-3 head in {path} does not fit its config: {e}") from None
    head.set_dtype(target_dtype(model))
    mx.eval(head.parameters(), head._held.to_target)
    return head
