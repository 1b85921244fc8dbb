"""Multi-token-prediction heads shipped inside a checkpoint: kept, loaded and run as a drafter.

mlx-lm's loaders drop a checkpoint's MTP weights (``mtp.*``, ``model.layers.{N}.*``) on some
paths only; specmlx's load of the target leaves them all out (``without_head``). This
module reads them from the same safetensors and builds the head from the family's own mlx-lm
decoder layer (no model file is forked). One step of a head, for the pair (h_i, t_{i+1}) at
position i:

    x   = fc([norm_e(embed(t_{i+1})), norm_h(h_i)])     # (B, L, 2H) -> (B, L, H)
    g_i = norm(layer(x))                                # one decoder layer with its own KV cache
    p(t_{i+2}) from the target's LM head on g_i

h_i is the target's final (post-norm) hidden state at position i (hidden.HiddenTap's
"final"); a chained step feeds g_i back in place of h (the same layer reused, as vLLM and
SGLang do for a one-layer head). The head's cache position of a pair is i, the position of
its hidden state (vLLM's proposer keeps the target's positions and shifts the tokens).

Families. ``qwen3_next`` (Qwen3-Next), ``qwen3_5`` and ``qwen3_5_moe`` (Qwen3.5/3.6), layout
and forward from vLLM's ``qwen3_next_mtp.py`` and ``qwen3_5_mtp.py``, with SGLang's
``qwen3_next_mtp.py`` and mlx-lm PR 990 agreeing on the concatenation order: weights under
``mtp.``, one full-attention decoder layer (MoE when the model is), norms stored zero-centred
(the weight is 1 + w), which mlx-lm undoes for the main model of a raw checkpoint and this
module undoes for the head. ``deepseek_v3`` (DeepSeek-V3/R1) and ``glm4_moe`` (GLM-4.5/4.6),
from vLLM's ``deepseek_mtp.py`` and ``glm4_moe_mtp.py`` (SGLang's ``deepseek_nextn.py``
agrees on the layout and the order): weights under ``model.layers.{N}`` (N: the config's
num_hidden_layers) as ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a decoder
layer of the model's own kind (MLA attention for DeepSeek; MoE, since N is past
first_k_dense_replace); plain RMSNorms; the embedding of the pair at position 0 zeroed, as
vLLM does. Their ``shared_head.head`` and ``embed_tokens`` copy the target's and are not
read. A chained step feeds back the output after ``shared_head.norm``, as SGLang does (vLLM
feeds the layer's output before it; the head was trained for one step only, either way).
Only the first of several MTP layers is read. Not read: MiMo's heads (``mtp_layers``), Qwen3.6's
fused expert tensors inside the head, and mlx-lm's other MLA families (deepseek_v2, kimi,
glm4_moe_lite).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v3, glm4_moe, qwen3_5, qwen3_next
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ...errors import BadInput, IncompatiblePair, ModelLoadError
from .targetparts import TargetParts

# the checkpoint's names of the head's parts (after "mtp.") -> this module's
_QWEN_NAMES = {
    "pre_fc_norm_embedding": "norm_e",
    "pre_fc_norm_hidden": "norm_h",
    "fc": "fc",
    "layers.0": "layer",
    "norm": "norm",
}
# norms a raw Qwen checkpoint stores zero-centred (mlx-lm adds 1 to the main model's)
_QWEN_SHIFTED = re.compile(
    r"^(norm_e|norm_h|norm|layer\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm))"
    r"\.weight$"
)


# DeepSeek-V3's and GLM-4.5's names (after "model.layers.{N}.") -> this module's; their
# shared_head.head and embed_tokens (copies of the target's) are left out, so not read
_NEXTN_NAMES = {
    "enorm": "norm_e",
    "hnorm": "norm_h",
    "eh_proj": "fc",
    "shared_head.norm": "norm",
    "self_attn": "layer.self_attn",
    "mlp": "layer.mlp",
    "input_layernorm": "layer.input_layernorm",
    "post_attention_layernorm": "layer.post_attention_layernorm",
}


@dataclass(frozen=True)
class MTPFamily:
    """How one model family's MTP head is built, named and run.

    layer(args): the family's decoder layer for the head; args(model): the text model's
    ModelArgs; prefix(args): what the head's tensor names start with in the checkpoint (the
    first head's, the one read); in_head(name, args): whether a checkpoint's tensor belongs
    to any of its heads (what the target's load leaves out); names: the
    checkpoint's names (after the prefix) -> this module's (norm_e, norm_h, fc, layer, norm;
    others are not read); centred: a raw checkpoint stores the norms zero-centred (1 + w);
    zero_first: the embedding of the pair at position 0 is zeroed; mask(x, cache): the
    decoder layer's attention mask, made as the family's own model makes it; sanitize(model,
    weights): the checkpoint's conversions (dequantization, expert stacking) by the family's
    own code, on names after the prefix (None: only the experts are stacked, in _rename)."""

    layer: Callable[[object], nn.Module]
    args: Callable[[nn.Module], object]
    prefix: Callable[[object], str] = lambda args: "mtp."
    in_head: Callable[[str, object], bool] = lambda name, args: _under(name, "mtp.")
    names: dict[str, str] = field(default_factory=lambda: _QWEN_NAMES)
    centred: bool = True
    zero_first: bool = False
    mask: Callable[[mx.array, object], object] = create_attention_mask
    sanitize: Callable[[nn.Module, dict], dict] | None = None


def _qwen3_next_layer(args) -> nn.Module:
    # the layer index picks the kind: the last of each interval is full attention
    return qwen3_next.Qwen3NextDecoderLayer(args, args.full_attention_interval - 1)


def _qwen3_5_layer(args) -> nn.Module:
    return qwen3_5.DecoderLayer(args, args.full_attention_interval - 1)


def _deepseek_v3_layer(args) -> nn.Module:
    # built at the MTP layer's own index, so MoE or dense as vLLM's DeepseekV2DecoderLayer
    # decides from the prefix (MoE: N is past first_k_dense_replace)
    return deepseek_v3.DeepseekV3DecoderLayer(args, args.num_hidden_layers)


def _glm4_moe_layer(args) -> nn.Module:
    return glm4_moe.DecoderLayer(args, args.num_hidden_layers)


def _mla_mask(x: mx.array, cache) -> object:
    # DeepseekV3Model's: its MLA attention applies the mask to its rope scores itself, so it
    # needs an array, never the "causal" string
    return create_attention_mask(x, cache, return_array=True)


def _nextn_prefix(args) -> str:
    return f"model.layers.{args.num_hidden_layers}."


def _under(name: str, prefix: str) -> bool:
    """``name`` starts with ``prefix`` at a dot: at the start or under a wrapper's prefix
    ("model.language_model.", "language_model."), as _mtp_weights finds the head."""
    return name.startswith(prefix) or f".{prefix}" in name


_LAYER = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")


def _past_the_layers(name: str, args) -> bool:
    # every MTP layer, not only the first (the one read): they follow the main layers
    m = _LAYER.search(name)
    return m is not None and int(m.group(1)) >= args.num_hidden_layers


def _as_main_layer(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The family's own ``Model.sanitize`` (mlx-lm's) on the head's tensors, posed as main
    layer 0's: FP8 blocks dequantized, per-expert weights stacked for SwitchGLU and, for
    DeepSeek, kv_b_proj split for MLA, as for the main layers. (Posed, because sanitize
    drops the MTP layer's own index; layer 0 is never the one it drops.)

    model: the target; weights: the head's tensors, named after the prefix."""
    posed = {f"model.layers.0.{k}": v for k, v in weights.items()}
    return {k.removeprefix("model.layers.0."): v for k, v in model.sanitize(posed).items()}


_NEXTN = dict(
    args=lambda m: m.args,
    prefix=_nextn_prefix,
    in_head=_past_the_layers,
    names=_NEXTN_NAMES,
    centred=False,
    zero_first=True,
    sanitize=_as_main_layer,
)

FAMILIES = {
    "qwen3_next": MTPFamily(_qwen3_next_layer, lambda m: m.args),
    "qwen3_5": MTPFamily(_qwen3_5_layer, lambda m: m.language_model.args),
    "qwen3_5_moe": MTPFamily(_qwen3_5_layer, lambda m: m.language_model.args),
    "deepseek_v3": MTPFamily(_deepseek_v3_layer, mask=_mla_mask, **_NEXTN),
    "glm4_moe": MTPFamily(_glm4_moe_layer, **_NEXTN),
}


class MTPHead(nn.Module):
    """One MTP layer over a target (see the module's docstring for the math).

    target: the mlx-lm model whose hidden states, embedding and LM head the head uses;
    family: a key of FAMILIES. Weights are random until ``load_weights``."""

    reads_hidden = ("final",)  # where hidden.HiddenTap reads the target for this head

    def __init__(self, target: nn.Module, family: str):
        super().__init__()
        if family not in FAMILIES:
            raise BadInput(f"no MTP head is known for {family} (known: {', '.join(FAMILIES)})")
        self.family = family
        args = FAMILIES[family].args(target)
        h, eps = args.hidden_size, args.rms_norm_eps
        self.norm_e = nn.RMSNorm(h, eps=eps)
        self.norm_h = nn.RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = FAMILIES[family].layer(args)
        self.norm = nn.RMSNorm(h, eps=eps)
        self._shared = TargetParts.of(target)

    def __call__(
        self, hidden: mx.array, tokens: mx.array, cache: list
    ) -> tuple[mx.array, mx.array]:
        """hidden (B, L, H): the target's (or the previous step's) hidden states at positions
        i..i+L-1; tokens (B, L): the tokens at positions i+1..i+L; cache: [KVCache] holding
        i pairs. Returns (g (B, L, H), logits (B, L, V)): g feeds a chained step."""
        family = FAMILIES[self.family]
        e = self._shared.embed(tokens)
        if family.zero_first:
            # vLLM's "masking inputs at position 0, as not needed by MTP": the pair at
            # position 0 keeps only its hidden state (a batch's rows: each at its own
            # length, core.batch_caches.BatchKVCache.lens)
            lens = getattr(cache[0], "lens", None)
            first = [n == 0 for n in lens] if lens is not None else [cache[0].offset == 0]
            if any(first):
                at = mx.array(first)[:, None, None]  # (B or 1, 1, 1)
                e = mx.concatenate([mx.where(at, 0, e[:, :1]), e[:, 1:]], axis=1)
        x = self.fc(mx.concatenate([self.norm_e(e), self.norm_h(hidden)], axis=-1))
        mask = family.mask(x, cache[0])
        g = self.norm(self.layer(x, mask, cache[0]))
        return g, self._shared.head(g)

    def make_cache(self) -> list:
        return [KVCache()]


def _family_of(config: dict) -> str:
    return config.get("model_type", "")


def _no_head(config: dict, where) -> None:
    family = _family_of(config) or "an unknown family"
    raise IncompatiblePair(
        f"{where} ({family}) has no MTP head (--draft mtp needs one: "
        f"{', '.join(FAMILIES)} checkpoints as Hugging Face ships them)"
    )


def check_family(config: dict, where) -> None:
    """IncompatiblePair, before anything loads, for a family with no known MTP head."""
    if _family_of(config) not in FAMILIES:
        _no_head(config, where)


def without_head(model: nn.Module, config: dict, weights: dict) -> dict:
    """``weights`` less every tensor of the checkpoint's MTP heads, for the target's own load:
    mlx-lm's sanitize drops them only on some paths (Qwen3-Next's only when it stacks
    experts, DeepSeek-V3's only at layer 61) and refuses the rest as parameters not in the
    model. The head is read from the same files by load_mtp. A family with no known head
    gets ``weights`` back as they are.

    model: the target as mlx-lm built it (its args say where the main layers end); config:
    its config.json; weights: the checkpoint's tensors by name, as mlx-lm read them."""
    fam = FAMILIES.get(_family_of(config))
    if fam is None:
        return weights
    args = fam.args(model)
    return {k: v for k, v in weights.items() if not fam.in_head(k, args)}


# a head trained by `specmlx distill --head mtp`, kept beside the checkpoint's own files in
# the checkpoint's layout: read in place of any head those files carry
TRAINED_FILE = "mtp.safetensors"
# the families whose head distill writes back (the Qwen layout: renaming is all there is to
# undo; DeepSeek's and GLM's go through their sanitize, which has no inverse here)
TRAINABLE = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _mtp_weights(path: Path, prefix: str) -> dict[str, mx.array]:
    """Every tensor under ``prefix`` (the family's: "mtp.", "model.layers.61.") in a model
    directory's safetensors, named after it (lazy: mx.load maps them); a trained head's
    TRAINED_FILE alone where there is one."""
    out = {}
    own = path / TRAINED_FILE
    for f in [own] if own.is_file() else sorted(path.glob("*.safetensors")):
        try:
            arrays = mx.load(str(f))
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
        for k, v in arrays.items():
            i = k.find(prefix)
            if i >= 0 and (i == 0 or k[i - 1] == "."):
                out[k[i + len(prefix) :]] = v
    return out


def checkpoint_tensors(head: MTPHead, raw: bool) -> dict[str, mx.array]:
    """A (Qwen-family) head's tensors under the names its checkpoint gives them: load_mtp's
    renaming undone, the norms zero-centred again for a ``raw`` checkpoint (one as Hugging
    Face ships it: is_raw), experts as mlx-lm stacks them (which the load takes as they are).
    BadInput for a family whose head cannot be written back (TRAINABLE)."""
    if head.family not in TRAINABLE:
        raise BadInput(f"an MTP head of {head.family} cannot be written back (only {TRAINABLE})")
    back = {new: old for old, new in _QWEN_NAMES.items()}
    out = {}
    for k, v in tree_flatten(head.parameters()):
        top, _, rest = k.partition(".")
        name = back[top] + (f".{rest}" if rest else "")
        out["mtp." + name] = v - 1.0 if raw and _QWEN_SHIFTED.match(k) else v
    return out


def is_raw(path: Path) -> bool:
    """A checkpoint as Hugging Face ships it (mlx-lm has not converted it): its linear
    attention's conv1d is stored (C, 1, K), which mlx-lm moves to (C, K, 1)."""
    for f in sorted(path.glob("*.safetensors")):
        for k, v in mx.load(str(f)).items():
            if k.endswith("conv1d.weight"):
                return v.shape[-1] != 1
    return False


def _rename(
    weights: dict[str, mx.array], names: dict[str, str], experts: int
) -> dict[str, mx.array]:
    """The checkpoint's names -> this module's (``names``: the family's map); per-expert
    weights still apart stacked for mlx-lm's SwitchGLU (as the family's own sanitize does
    for the main layers) over ``experts`` experts."""
    out = {}
    for k, v in weights.items():
        for old, new in names.items():
            if k == old or k.startswith(old + "."):
                out[new + k[len(old) :]] = v
                break
    for n in ("gate_proj", "up_proj", "down_proj"):
        first = f"layer.mlp.experts.0.{n}.weight"
        if first in out:
            parts = [out.pop(f"layer.mlp.experts.{e}.{n}.weight") for e in range(experts)]
            out[f"layer.mlp.switch_mlp.{n}.weight"] = mx.stack(parts)
    return out


def load_mtp(model: nn.Module, config: dict, path: Path, quantize=None) -> MTPHead:
    """The checkpoint's MTP head over ``model`` (its loaded target).

    model: the target as mlx-lm loaded it; config: its config.json; path: the checkpoint
    directory holding the head's tensors (the source, not a quantized copy, which mlx-lm
    saved without them); quantize: (bits, group_size) to quantize the head's linear layers
    to, as the target was at load, or None. A checkpoint already quantized on disk is read
    as it is. ModelLoadError when there are no heads or they do not fit."""
    family = _family_of(config)
    check_family(config, path)
    fam = FAMILIES[family]
    args = fam.args(model)
    weights = _mtp_weights(path, fam.prefix(args)) if path.is_dir() else {}
    if not weights:
        _no_head(config, path)
    head = MTPHead(model, family)
    if fam.sanitize is not None:
        weights = fam.sanitize(model, weights)
    weights = _rename(weights, fam.names, getattr(args, "num_experts", 0))
    if fam.centred and is_raw(path):
        weights = {k: v + 1.0 if _QWEN_SHIFTED.match(k) else v for k, v in weights.items()}
    q = config.get("quantization")
    # quantized on disk (the target's config then says how); a target quantized at load has
    # "quantization" in its config too, but the head read from the source is not
    on_disk = bool(q) and any(k.endswith(".scales") for k in weights)
    if on_disk:
        nn.quantize(
            head, q["group_size"], q["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )  # fmt: skip
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"the MTP head in {path} does not fit {family}: {e}") from None
    if quantize is not None and not on_disk:
        bits, group = quantize
        nn.quantize(head, group, bits, class_predicate=lambda p, m: hasattr(m, "to_quantized"))
    leaves = tree_flatten(model.parameters())
    dtype = next(v.dtype for _, v in leaves if mx.issubdtype(v.dtype, mx.floating))
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    return head
