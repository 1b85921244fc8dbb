"""GGUF files: header reader, llama tensor names → mlx-lm names, and weights (kept quantized
or dequantized). The tokenizer is rebuilt from the metadata in gguf_tokenizer.py."""

from __future__ import annotations

import mmap
import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .errors import ModelLoadError
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
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


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
    """An HF-style llama config.json built from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF architecture '{arch}' is not supported (only llama)")
    need = ["embedding_length", "block_count", "feed_forward_length", "attention.head_count"]
    missing = [k for k in need if f"llama.{k}" not in meta]
    if missing or "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF lacks llama.{(missing or ['token_embd'])[0]}")
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": meta["llama.block_count"],
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.attention.key_length", hidden // heads),
        "rms_norm_eps": meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.get("llama.context_length"),
        "vocab_size": tensors["token_embd.weight"][1][0],
        "tie_word_embeddings": "output.weight" not in tensors,
        # llama.cpp's converter permutes q/k for the interleaved (traditional) rotation.
        "rope_traditional": True,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if meta.get("llama.rope.scaling.type") == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": meta["llama.rope.scaling.factor"]}
    return config


def _mlx_name(name: str, path: Path) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(\w+)", name)
    base, _, leaf = name.rpartition(".")
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{leaf}"
    raise ModelLoadError(f"{path}: unexpected tensor '{name}'; only plain llama GGUFs load")


def load_gguf(path: Path, dtype: mx.Dtype, keep_quantized: bool):
    """Build an mlx-lm llama from a GGUF: quantized triples kept or dequantized to dtype."""
    from mlx_lm.models import llama

    meta, tensors = read_gguf_header(path)
    config = gguf_config(meta, tensors, path)
    bad = [(n, t) for n, (t, _) in tensors.items() if t not in _MX_READABLE]
    if bad:
        raise ModelLoadError(
            f"{path}: GGUF tensor type {bad[0][1]} (e.g. {bad[0][0]}) is not supported; "
            "use a Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, F16 or F32 file"
        )
    try:
        raw = mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        msg = str(e).splitlines()[0]
        if "gguf_tensor_to_f16" in msg:
            kinds = sorted({t for t, _ in tensors.values()})
            raise ModelLoadError(
                f"{path}: MLX cannot read this GGUF's tensor types ({', '.join(kinds)}); "
                "use a Q4_0, Q4_1, Q8_0 or F16 file"
            ) from None
        raise ModelLoadError(f"{path} is truncated or corrupt ({msg}); re-download it") from None
    model = llama.Model(llama.ModelArgs.from_dict(config))
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    weights = {_mlx_name(k, path): v for k, v in raw.items()}
    quant = {}
    for name in [n for n in weights if n.endswith(".scales")]:
        base = name[: -len(".scales")]
        in_dims = shapes.get(f"{base}.weight", (0,))[-1]
        gs = in_dims // weights[name].shape[-1]
        quant[base] = {
            "group_size": gs,
            "bits": weights[f"{base}.weight"].shape[-1] * 32 // in_dims,
        }
    if keep_quantized:
        nn.quantize(model, class_predicate=lambda p, _: quant.get(p, False))
        config["quantization"] = {"group_size": 32, "bits": 4, "mode": "affine", **quant}
    else:
        for base, q in quant.items():
            w, s, b = (weights.pop(f"{base}.{k}") for k in ("weight", "scales", "biases"))
            weights[f"{base}.weight"] = mx.dequantize(w, s.astype(dtype), b.astype(dtype), **q)
    # float16 scales are very slow on x86 CPUs: every float goes to dtype (float32 there).
    for k, v in weights.items():
        if mx.issubdtype(v.dtype, mx.floating):
            weights[k] = v.astype(dtype)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{path}: tensors do not fit a llama model: {e}") from None
    return model, gguf_tokenizer(meta, path), config
