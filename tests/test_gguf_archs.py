"""GGUF files of each architecture specmlx maps (llama.cpp's names and conversions), checked
against an independent reference: a tiny random mlx-lm model is written by llama.cpp's own
gguf package (its writer and quantizers, the tensors in Q8_0, Q5_0, Q4_1 and F16 in turn,
Gemma's norms stored as w + 1 as llama.cpp's converter does), loaded through specmlx, and its
logits compared with the same mlx-lm model holding the gguf package's dequantized weights."""

import importlib

import gguf
import mlx.core as mx
import numpy as np
import pytest
from helpers import tiny_tokenizer, tokenizer_meta
from mlx.utils import tree_flatten

from specmlx.engine import generate_tokens
from specmlx.gguf import _TOP_NAMES, ARCHS, load_gguf

Q = gguf.GGMLQuantizationType
KINDS = [Q.Q8_0, Q.Q5_0, Q.Q4_1, Q.F16]  # 2-D tensors take these in turn; 1-D stay F32
WINDOW = 8


def _config(arch: str, vocab: int) -> tuple[dict, dict]:
    """(mlx-lm config, GGUF metadata) for a tiny model of ``arch``."""
    base = dict(hidden_size=64, num_hidden_layers=6, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                rms_norm_eps=1e-6, vocab_size=vocab, rope_theta=10000.0,
                max_position_embeddings=512)  # fmt: skip
    meta = {
        "embedding_length": 64, "block_count": 6, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16,
        "attention.value_length": 16, "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 10000.0, "context_length": 512,
    }  # fmt: skip
    config = dict(base, model_type=ARCHS[arch].model_type, tie_word_embeddings=arch == "gemma3")
    if arch == "qwen3moe":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
        meta.update({"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32})
    if arch == "starcoder2":
        config.update(norm_epsilon=1e-5, head_dim=16)
        meta["attention.layer_norm_epsilon"] = 1e-5
    if arch == "gemma3":
        config.update(sliding_window=WINDOW, sliding_window_pattern=6, query_pre_attn_scalar=16,
                      rope_local_base_freq=10000.0)  # fmt: skip
        meta["attention.sliding_window"] = WINDOW
    return config, {f"{arch}.{k}": v for k, v in meta.items()}


def _gguf_name(name: str, arch: str) -> str:
    back = {v: k for k, v in ARCHS[arch].names.items()}
    top = {v: k for k, v in _TOP_NAMES.items()}
    base, _, leaf = name.rpartition(".")
    if base in top:
        return f"{top[base]}.{leaf}"
    _, _, layer, *rest = base.split(".")
    return f"blk.{layer}.{back['.'.join(rest)]}.{leaf}"


def _add(writer, key: str, value) -> None:
    T = gguf.GGUFValueType
    if isinstance(value, bool):
        writer.add_key_value(key, value, T.BOOL)
    elif isinstance(value, int):
        writer.add_key_value(key, value, T.UINT32)
    elif isinstance(value, float):
        writer.add_key_value(key, value, T.FLOAT32)
    elif isinstance(value, str):
        writer.add_key_value(key, value, T.STRING)
    else:
        sub = T.STRING if isinstance(value[0], str) else T.INT32
        writer.add_key_value(key, list(value), T.ARRAY, sub_type=sub)


def write_tiny(tmp_path, arch: str):
    """(path of the GGUF, the reference mlx-lm model)."""
    tok = tiny_tokenizer()
    config, meta = _config(arch, len(tok))
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(5)
    ref = module.Model(module.ModelArgs.from_dict(config))
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for k, v in {**meta, **tokenizer_meta(tok)}.items():
        if k != "general.architecture":
            _add(writer, k, v)
    rounded, i = [], 0
    for name, w in tree_flatten(ref.parameters()):
        x = np.array(w, dtype=np.float32)
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + 1.0  # llama.cpp's converter stores Gemma's norms shifted
        kind = KINDS[i % len(KINDS)] if x.ndim >= 2 else Q.F32
        i += x.ndim >= 2
        data = gguf.quants.quantize(x, kind) if kind != Q.F32 else x
        back = gguf.quants.dequantize(data, kind).reshape(x.shape)
        if arch == "gemma3" and name.endswith("norm.weight"):
            back = back - 1.0
        rounded.append((name, mx.array(back)))
        writer.add_tensor(_gguf_name(name, arch), data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref.load_weights(rounded)
    mx.eval(ref.parameters())
    return path, ref


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3moe", "starcoder2", "gemma3"])
def test_each_gguf_architecture_loads_the_weights_it_was_written_with(tmp_path, arch):
    path, ref = write_tiny(tmp_path, arch)
    model, tokenizer, config = load_gguf(path, mx.float32, keep_quantized=False)
    assert config["model_type"] == ARCHS[arch].model_type
    x = mx.array([list(range(3, 3 + 3 * WINDOW))])  # past the window (gemma3)
    assert mx.allclose(model(x), ref(x), atol=1e-4), arch
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n" * 2)
    plain = [e.token for e in generate_tokens(model, None, ids, num_draft=0, max_tokens=24)]
    look = generate_tokens(model, None, ids, num_draft=4, lookup=True, max_tokens=24)
    assert [e.token for e in look] == plain


def test_a_gemma3_gguf_without_the_norm_shift_undone_differs(tmp_path, monkeypatch):
    """The check sees llama.cpp's + 1: loading Gemma's norms as stored gives other logits."""
    path, ref = write_tiny(tmp_path, "gemma3")
    monkeypatch.setitem(ARCHS, "gemma3", ARCHS["gemma3"].__class__(
        "gemma3_text", ARCHS["gemma3"].names, extra=ARCHS["gemma3"].extra))  # fmt: skip
    model, _, _ = load_gguf(path, mx.float32, keep_quantized=False)
    x = mx.array([[3, 4, 5, 6]])
    assert not mx.allclose(model(x), ref(x), atol=1e-2)
