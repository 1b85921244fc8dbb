"""GGUF files: the header reader, and the load: llama.cpp's tensor names -> mlx-lm's for the
architecture's `Arch` entry (gguf_archs.py: the llama-like families; gguf_hybrids.py: the
gated-delta, short-conv and Mamba-2 hybrids), its config built from the metadata, and the
weights (kept quantized or dequantized). Where llama.cpp's convert_hf_to_gguf.py changed a
tensor on writing (Gemma's norm + 1 here; the hybrids' changes in their entries' undo), the
load undoes it into mlx-lm's own layout. A bundled MTP head's blocks (counted in
block_count) are left out. The tokenizer is rebuilt from the metadata in gguf_tokenizer.py.

Weights MLX reads itself (F32/F16/BF16, Q4_0/Q4_1/Q8_0 as MLX triples, Q2_K/Q4_K/Q6_K) go
through mx.load; a file with any other type (a Q4_K_M mixes Q4_K, Q5_0, Q6_K and Q8_0) is
dequantized tensor by tensor by llama.cpp's own gguf package, which reads every type."""

from __future__ import annotations

import importlib
import mmap
import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ModelLoadError
from .gguf_archs import BLOCK_NAMES as _BLOCK_NAMES  # noqa: F401 - tests/helpers.py's name
from .gguf_archs import LLAMA_ARCHS, Arch, per_layer
from .gguf_archs import TOP_NAMES as _TOP_NAMES  # noqa: F401 - tests/helpers.py's name
from .gguf_hybrids import HYBRID_ARCHS
from .gguf_tokenizer import gguf_tokenizer

GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip
MX_QUANTIZED = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # mx.load keeps these as MLX triples
_MX_READABLE = {"F32", "F16", "BF16", "Q2_K", "Q4_K", "Q6_K", *MX_QUANTIZED}  # others fail
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_GGUF_SCALARS |= {11: "q", 12: "d"}

ARCHS = {**LLAMA_ARCHS, **HYBRID_ARCHS}  # every architecture a GGUF may name


def read_gguf_header(path: Path) -> tuple[dict, dict[str, tuple[str, tuple[int, ...]]]]:
    """A GGUF file's metadata and its tensors' (type name, shape), without reading tensor data."""
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    pos = 0

    def take(fmt: str, n: int = 1):
        nonlocal pos
        vals = struct.unpack_from(f"<{n}{fmt}", buf, pos)
        pos += struct.calcsize(f"<{n}{fmt}")
        return vals[0] if n == 1 else list(vals)

    def string() -> str:
        nonlocal pos
        n = take("Q")
        if pos + n > len(buf):
            raise struct.error("string past end of file")
        pos += n
        return buf[pos - n : pos].decode("utf-8", errors="replace")

    def value(kind: int):
        if kind == 8:
            return string()
        if kind == 9:
            inner, n = take("I"), take("Q")
            if inner in _GGUF_SCALARS:
                return take(_GGUF_SCALARS[inner], n) if n else []
            return [value(inner) for _ in range(n)]
        return take(_GGUF_SCALARS[kind])

    try:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
        pos = 4
        version, n_tensors, n_kv = take("I"), take("Q"), take("Q")
        if version < 2:
            raise ModelLoadError(f"{path} is GGUF version {version}; re-convert it with llama.cpp")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(take("I"))
        tensors = {}
        for _ in range(n_tensors):
            name = string()
            dims = take("Q", take("I"))
            dims = tuple(dims) if isinstance(dims, list) else (dims,)
            kind = take("I")
            take("Q")  # data offset
            tensors[name] = (GGML_TYPES.get(kind, f"type {kind}"), dims[::-1])
    except (struct.error, KeyError, OverflowError, MemoryError):
        raise ModelLoadError(f"{path} is truncated or corrupt: re-download it") from None
    finally:
        buf.close()
    return meta, tensors


def gguf_config(meta: dict, tensors: dict, path: Path) -> dict:
    """An HF-style config.json for the mlx-lm model class, built from GGUF metadata."""
    name = meta.get("general.architecture")
    if name not in ARCHS:
        raise ModelLoadError(
            f"{path}: GGUF architecture '{name}' is not supported ({', '.join(ARCHS)})"
        )
    arch = ARCHS[name]
    need = ["embedding_length", "block_count", "feed_forward_length", "attention.head_count"]
    if f"{name}.expert_count" in meta:  # all-MoE files (Qwen3.5-MoE) may have no dense width
        need.remove("feed_forward_length")
    need += arch.needs
    missing = [k for k in need if f"{name}.{k}" not in meta]
    if missing or "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF lacks {name}.{(missing or ['token_embd'])[0]}")

    def get(key, default=None):
        return meta.get(f"{name}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    # Mamba 2 writes head_count 0 (Mamba2Model.set_gguf_parameters: "unused")
    head_dim = get("attention.key_length", hidden // heads if heads else 0)
    config = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        # llama.cpp's converter counts a bundled MTP head's blocks in block_count (Qwen3.5's
        # _Qwen35MtpMixin; GLM/DeepSeek nextn): the model has that many fewer
        "num_hidden_layers": get("block_count") - get("nextn_predict_layers", 0),
        "intermediate_size": get("feed_forward_length", 0),
        "num_attention_heads": heads,
        "num_key_value_heads": max(per_layer(get("attention.head_count_kv", heads))),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": tensors["token_embd.weight"][1][0],
        "tie_word_embeddings": "output.weight" not in tensors,
        "rope_traditional": arch.rope_traditional,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        **arch.extra,
    }
    if get("rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": get("rope.scaling.factor")}
    if name == "qwen3moe":
        config["num_experts"] = get("expert_count")
        config["num_experts_per_tok"] = get("expert_used_count")
        config["moe_intermediate_size"] = get("expert_feed_forward_length")
    if name == "starcoder2":  # LayerNorm with biases, its own epsilon key
        config["norm_epsilon"] = get("attention.layer_norm_epsilon", 1e-5)
    if name == "gemma3":
        config["sliding_window"] = get("attention.sliding_window", 512)
        config["query_pre_attn_scalar"] = head_dim  # llama.cpp scales by 1/sqrt(head_dim)
    if arch.configure:
        config.update(arch.configure(get, tensors, config, path))
    return config


def _mlx_name(name: str, path: Path, arch: Arch) -> str:
    """llama.cpp's name -> mlx-lm's: a block's tensor by its name less the leaf (weight, bias,
    scales, biases), or by its whole name where the leaf is mlx-lm's too (ssm_a -> A_log)."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m:
        rest = m.group(2)
        base, _, leaf = rest.rpartition(".")
        if rest in arch.names:
            return f"{arch.layers}.{m.group(1)}.{arch.names[rest]}"
        if base in arch.names:
            return f"{arch.layers}.{m.group(1)}.{arch.names[base]}.{leaf}"
    base, _, leaf = name.rpartition(".")
    if base in arch.top:
        return f"{arch.top[base]}.{leaf}"
    raise ModelLoadError(f"{path}: unexpected tensor '{name}' for its architecture")


def _dequantized(path: Path) -> dict[str, mx.array]:
    """Every tensor of a GGUF as float32, dequantized by llama.cpp's gguf package (any type
    it knows), in mlx-lm's (rows, columns) order."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
        out = {}
        for t in reader.tensors:
            shape = tuple(int(n) for n in reversed(t.shape))
            out[t.name] = mx.array(dequantize(t.data, t.tensor_type).reshape(shape))
        return out
    except (ValueError, NotImplementedError, KeyError) as e:
        raise ModelLoadError(f"{path}: cannot dequantize it ({e})") from None


def load_gguf(path: Path, dtype: mx.Dtype, keep_quantized: bool):
    """Build the mlx-lm model of a GGUF's architecture: Q4_0/Q4_1/Q8_0 triples kept quantized
    (``keep_quantized``, when MLX reads the file itself) or everything dequantized to dtype."""
    meta, tensors = read_gguf_header(path)
    config = gguf_config(meta, tensors, path)
    arch = ARCHS[meta["general.architecture"]]
    unknown = sorted({t for t, _ in tensors.values() if t.startswith("type ")})
    if unknown:
        raise ModelLoadError(f"{path}: GGUF tensor {unknown[0]} is not a known ggml type")
    native = all(t in _MX_READABLE for t, _ in tensors.values())
    if native:
        try:
            raw = mx.load(str(path))
        except (RuntimeError, ValueError) as e:
            msg = str(e).splitlines()[0]
            if "gguf_tensor_to_f16" not in msg:
                raise ModelLoadError(
                    f"{path} is truncated or corrupt ({msg}); re-download it"
                ) from None
            native = False  # MLX could not convert some tensor: the gguf package can
    if not native:
        raw = _dequantized(path)
    module = importlib.import_module(f"mlx_lm.models.{arch.model_type}")
    model = module.Model(module.ModelArgs.from_dict(config))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    # a bundled MTP head's blocks (blk.N.* past the model's layers) are not the model's
    n = config["num_hidden_layers"]
    mtp = [k for k in raw if (m := re.match(r"blk\.(\d+)\.", k)) and int(m.group(1)) >= n]
    for k in mtp:
        del raw[k]
    weights = {_mlx_name(k, path, arch): v for k, v in raw.items()}
    quant = {}
    for name in [n for n in weights if n.endswith(".scales")]:
        base = name[: -len(".scales")]
        # a tensor the model lacks (one an undo below rebuilds): ggml's 32-wide blocks
        in_dims = shapes.get(f"{base}.weight", (weights[name].shape[-1] * 32,))[-1]
        gs = in_dims // weights[name].shape[-1]
        quant[base] = {
            "group_size": gs,
            "bits": weights[f"{base}.weight"].shape[-1] * 32 // in_dims,
        }
    # kept quantized when asked, except what an undo rearranges: that is dequantized first
    keep = {b: q for b, q in quant.items() if keep_quantized and not b.endswith(arch.rearranged)}
    if keep:
        nn.quantize(model, class_predicate=lambda p, _: keep.get(p, False))
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine", **keep}
    for base, q in quant.items():
        if base not in keep:
            w, s, b = (weights.pop(f"{base}.{k}") for k in ("weight", "scales", "biases"))
            weights[f"{base}.weight"] = mx.dequantize(w, s.astype(dtype), b.astype(dtype), **q)
    # float16 scales are very slow on x86 CPUs: every float goes to dtype (float32 there),
    # except what mlx-lm keeps in float32 (its cast_predicate: Qwen3.5's A_log, LFM2-MoE's
    # expert bias); those are undone from float32 too
    keep32 = getattr(model, "cast_predicate", None) or (lambda _: True)
    for k, v in weights.items():
        if mx.issubdtype(v.dtype, mx.floating):
            if arch.norm_shift and k.endswith("norm.weight"):
                v = v.astype(mx.float32) - arch.norm_shift  # back to mlx-lm's (1 + w) form
            weights[k] = v.astype(dtype if keep32(k) else mx.float32)
    if arch.undo:
        weights = arch.undo(weights, config)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)  # e.g. Gemma's tied head: no lm_head
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not fit a {arch.model_type} model: {e}") from None
    return model, gguf_tokenizer(meta, path), config
