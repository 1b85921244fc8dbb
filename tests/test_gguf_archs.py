"""GGUF files of each architecture specmlx maps (llama.cpp's names and conversions), checked
against an independent reference: a tiny random mlx-lm model is written by llama.cpp's own
gguf package (its writer and quantizers, the tensors in Q8_0, Q5_0, Q4_1 and F16 in turn,
Gemma's norms stored as w + 1 as llama.cpp's converter does), loaded through specmlx, and its
logits compared with the same mlx-lm model holding the gguf package's dequantized weights."""

import importlib
import re
import zlib
from dataclasses import replace

import gguf
import mlx.core as mx
import numpy as np
import pytest
from helpers import generate, tiny_tokenizer, tokenizer_meta
from mlx.utils import tree_flatten

import specmlx.models.gguf_hybrids
from specmlx.errors import ModelLoadError
from specmlx.models.footprint import kv_bytes, layer_kinds
from specmlx.models.gguf import ARCHS, gguf_config, load_gguf
from specmlx.models.gguf_archs import TOP_NAMES
from specmlx.models.gguf_hybrids import _undo_gated_delta
from specmlx.models.loading import _set_dtype

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
    top = {v: k for k, v in TOP_NAMES.items()}
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


def _computes_as(model, ref, tokenizer) -> None:
    """The loaded model's logits are the reference's past any window or conv, and greedy lookup
    speculation on it is token-identical to plain decoding."""
    x = mx.array([list(range(3, 3 + 3 * WINDOW))])
    assert mx.allclose(model(x), ref(x), atol=1e-4)
    ids = tokenizer.encode("def add(a, b):\n    return a + b\n" * 2)
    plain = [e.token for e in generate(model, None, ids, k=0, max_tokens=24)]
    look = generate(model, None, ids, k=4, lookup=True, max_tokens=24)
    assert [e.token for e in look] == plain


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3moe", "starcoder2", "gemma3"])
def test_each_gguf_architecture_loads_the_weights_it_was_written_with(tmp_path, arch):
    path, ref = write_tiny(tmp_path, arch)
    model, tokenizer, config = load_gguf(path, mx.float32, keep_quantized=False)
    assert config["model_type"] == ARCHS[arch].model_type
    _computes_as(model, ref, tokenizer)


def test_a_gemma3_gguf_without_the_norm_shift_undone_differs(tmp_path, monkeypatch):
    """The check sees llama.cpp's + 1: loading Gemma's norms as stored gives other logits."""
    path, ref = write_tiny(tmp_path, "gemma3")
    monkeypatch.setitem(ARCHS, "gemma3", ARCHS["gemma3"].__class__(
        "gemma3_text", ARCHS["gemma3"].names, extra=ARCHS["gemma3"].extra))  # fmt: skip
    model, _, _ = load_gguf(path, mx.float32, keep_quantized=False)
    x = mx.array([[3, 4, 5, 6]])
    assert not mx.allclose(model(x), ref(x), atol=1e-2)


# ------------------------------------------------ gated-delta hybrids (Qwen3.5, Qwen3-Next)
# The reference here is independent of specmlx's name table: the tiny mlx-lm model's weights
# are put in HF's layout, rounded by the quantizers in that layout, named by the gguf
# package's own HF -> GGUF map and changed as llama.cpp's convert_hf_to_gguf.py changes them;
# the reference model gets the rounded HF weights through mlx-lm's own sanitize.
HYBRIDS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe", "qwen3next": "qwen3_next"}
NK, NV, DK, DV = 2, 4, 16, 32  # more value heads than key heads: Qwen3.5's V regrouping shows


def _hybrid_config(arch: str, vocab: int) -> tuple[dict, dict]:
    """(mlx-lm config, GGUF metadata as Qwen3NextModel.set_gguf_parameters writes it)."""
    rope = {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    config = dict(model_type=HYBRIDS[arch], hidden_size=64, num_hidden_layers=4,
                  intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, vocab_size=vocab, rope_theta=10000.0,
                  partial_rotary_factor=0.25, rope_parameters=rope,
                  max_position_embeddings=512, linear_num_key_heads=NK,
                  linear_num_value_heads=NV, linear_key_head_dim=DK, linear_value_head_dim=DV,
                  linear_conv_kernel_dim=4, full_attention_interval=2,
                  tie_word_embeddings=False)  # fmt: skip
    K = gguf.Keys
    meta = {
        K.LLM.CONTEXT_LENGTH: 512, K.LLM.EMBEDDING_LENGTH: 64, K.LLM.BLOCK_COUNT: 4,
        K.LLM.FEED_FORWARD_LENGTH: 128, K.Attention.HEAD_COUNT: 4,
        K.Attention.HEAD_COUNT_KV: 2, K.Attention.KEY_LENGTH: 16, K.Attention.VALUE_LENGTH: 16,
        K.Attention.LAYERNORM_RMS_EPS: 1e-6, K.Rope.FREQ_BASE: 10000.0,
        K.SSM.CONV_KERNEL: 4, K.SSM.STATE_SIZE: DK, K.SSM.GROUP_COUNT: NK,
        K.SSM.TIME_STEP_RANK: NV, K.SSM.INNER_SIZE: NV * DV,
        K.LLM.FULL_ATTENTION_INTERVAL: 2, K.Rope.DIMENSION_COUNT: 4,  # 16 x 0.25
    }  # fmt: skip
    if arch != "qwen35":
        config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
        meta.update({K.LLM.EXPERT_COUNT: 4, K.LLM.EXPERT_USED_COUNT: 2,
                     K.LLM.EXPERT_FEED_FORWARD_LENGTH: 32,
                     K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: 48})  # fmt: skip
    return config, {k.format(arch=arch): v for k, v in meta.items()}


def _hf_weights(model, config: dict) -> dict[str, np.ndarray]:
    """The mlx-lm model's weights in HF's layout (what mlx-lm's sanitize takes in): its norms
    are stored as 1 + w and its conv1d as (C, K, 1); MoE experts as HF ships them."""
    params = {k.removeprefix("language_model."): np.array(w, dtype=np.float32)
              for k, w in tree_flatten(model.parameters())}  # fmt: skip
    hf = {}
    for name, x in params.items():
        if name.endswith("conv1d.weight"):
            x = x.transpose(0, 2, 1)
        if name.endswith(("layernorm.weight", "model.norm.weight", "_norm.weight")):
            x = x - 1.0
        if ".switch_mlp." in name and config["model_type"] == "qwen3_next":  # one per expert
            for e in range(x.shape[0]):
                hf[name.replace("switch_mlp.", f"experts.{e}.")] = x[e]
        elif ".switch_mlp." in name:  # Qwen3.5-MoE: experts.gate_up_proj, experts.down_proj
            base = name.split("switch_mlp.")[0] + "experts."
            if "gate_proj" in name:
                up = params[name.replace("gate_proj", "up_proj")]
                hf[base + "gate_up_proj"] = np.concatenate([x, up], axis=-2)
            elif "down_proj" in name:
                hf[base + "down_proj"] = x
        else:
            hf[name] = x
    return hf


def _reorder_v_heads(x: np.ndarray, axis: int, dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py, _LinearAttentionVReorderBase._reorder_v_heads: V heads from
    grouped by key head to tiled."""
    shape = list(x.shape)
    x = x.reshape(*shape[:axis], NK, NV // NK, dim, *shape[axis + 1 :])
    return np.swapaxes(x, axis, axis + 1).reshape(shape)


def _tensor_map(arch: str, n_blocks: int = 4) -> gguf.TensorNameMap:
    """The gguf package's own HF -> GGUF name map for llama.cpp's ``arch``."""
    enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    return gguf.get_tensor_name_map(enum, n_blocks)


def _converted(arch: str, hf: dict[str, np.ndarray]):
    """(GGUF name, tensor, the HF name it came from), as convert_hf_to_gguf.py writes them."""
    tmap = _tensor_map(arch)
    experts: dict[str, list] = {}
    for name, x in hf.items():
        src = name
        if arch.startswith("qwen35") and "linear_attn." in name:
            # _LinearAttentionVReorderBase.modify_tensors (num_k_heads != num_v_heads)
            if ".in_proj_qkv." in name:
                x = np.concatenate([x[: 2 * NK * DK], _reorder_v_heads(x[2 * NK * DK :], 0, DV)])
            elif ".in_proj_z." in name:
                x = _reorder_v_heads(x, 0, DV)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                x = _reorder_v_heads(x, 0, 1)
            elif ".A_log" in name or ".dt_bias" in name:
                x = _reorder_v_heads(x[:, None], 0, 1)[:, 0]
            elif ".conv1d" in name:
                x = x.squeeze()
                x = np.concatenate([x[: 2 * NK * DK], _reorder_v_heads(x[2 * NK * DK :], 0, DV)])
            elif ".out_proj." in name:
                x = _reorder_v_heads(x, 1, DV)
        # Qwen3NextModel.modify_tensors
        if name.endswith(".A_log"):
            x = -np.exp(x)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            x = x.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + 1
        if "in_proj_qkvz.weight" in name:  # [q k v z] per key head -> [q.. k.. v..], [z..]
            bid = int(name.split(".")[2])
            q, k, v, z = np.split(x.T.reshape(64, NK, -1), np.cumsum([DK, DK, NV // NK * DV]), -1)
            qkv = np.concatenate([t.reshape(64, -1) for t in (q, k, v)], -1).T
            T, N = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
            yield N[T.ATTN_QKV].format(bid=bid) + ".weight", qkv, src
            yield N[T.ATTN_GATE].format(bid=bid) + ".weight", z.reshape(64, -1).T, src
            continue
        # Qwen2MoeModel.modify_tensors: fused gate_up split; per-expert tensors stacked
        if name.endswith("mlp.experts.down_proj"):
            name += ".weight"
        if name.endswith("mlp.experts.gate_up_proj"):
            base, n_ff = name.removesuffix(".gate_up_proj"), x.shape[-2] // 2
            for part, t in (("gate_proj", x[..., :n_ff, :]), ("up_proj", x[..., n_ff:, :])):
                yield tmap.get_name(f"{base}.{part}.weight", (".weight",)), t, src
            continue
        if ".experts." in name and name.split(".")[5].isdigit():
            key = re.sub(r"experts\.\d+\.", "experts.", name)
            experts.setdefault(key, []).append(x)
            if len(experts[key]) == 4:
                yield tmap.get_name(key, (".weight",)), np.stack(experts.pop(key)), src
            continue
        yield tmap.get_name(name, (".weight", ".bias")), x, src


def _kind(arch: str, hf_name: str, x: np.ndarray):
    """The ggml type a tensor is written in, by its HF name (all of one expert stack or of a
    split alike). Block quants round each row alone, so they commute with the converter's row
    reorders; Qwen3.5's out_proj has its columns reordered: F16 (elementwise) there."""
    if x.ndim < 2 or "conv1d" in hf_name or x.shape[-1] % 32:
        return Q.F32
    if arch.startswith("qwen35") and ".out_proj." in hf_name:
        return Q.F16
    return KINDS[zlib.crc32(re.sub(r"experts\.\d+\.", "", hf_name).encode()) % len(KINDS)]


# ------------------------------------------------------------- LFM2 (short conv + attention)
LFM2_TYPES = ["conv", "conv", "full_attention", "conv"]  # not periodic: the per-layer keys show
NE = 4  # experts


def _lfm2_config(arch: str, vocab: int) -> tuple[dict, dict]:
    """(mlx-lm config as HF's, GGUF metadata as LFM2Model/LFM2MoeModel.set_gguf_parameters
    write it: head_count_kv 0 on conv layers, the dense width adjusted)."""
    config = dict(model_type=HYBRIDS[arch], vocab_size=vocab, hidden_size=64,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, norm_eps=1e-5, conv_bias=False,
                  conv_L_cache=3, rope_theta=10000.0, layer_types=LFM2_TYPES)  # fmt: skip
    K = gguf.Keys
    meta = {
        K.LLM.CONTEXT_LENGTH: 512, K.LLM.EMBEDDING_LENGTH: 64, K.LLM.BLOCK_COUNT: 4,
        K.Attention.HEAD_COUNT: 4, K.Attention.LAYERNORM_RMS_EPS: 1e-5,
        K.Attention.HEAD_COUNT_KV: [0 if t == "conv" else 2 for t in LFM2_TYPES],
        K.Rope.FREQ_BASE: 10000.0, K.ShortConv.L_CACHE: 3, K.LLM.VOCAB_SIZE: vocab,
    }  # fmt: skip
    if arch == "lfm2":  # _add_feed_forward_length: int(2 * 192 / 3) rounded up to 32s
        config.update(block_dim=64, block_ff_dim=192, block_multiple_of=32,
                      block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True)  # fmt: skip
        meta[K.LLM.FEED_FORWARD_LENGTH] = 128
    else:
        config.update(intermediate_size=128, moe_intermediate_size=32, num_experts=NE,
                      num_experts_per_tok=2, norm_topk_prob=True, use_expert_bias=True,
                      num_dense_layers=1)  # fmt: skip
        meta.update({K.LLM.FEED_FORWARD_LENGTH: 128, K.LLM.EXPERT_FEED_FORWARD_LENGTH: 32,
                     K.LLM.EXPERT_COUNT: NE, K.LLM.EXPERT_USED_COUNT: 2,
                     K.LLM.LEADING_DENSE_BLOCK_COUNT: 1,
                     K.LLM.EXPERT_GATING_FUNC: gguf.ExpertGatingFuncType.SIGMOID})  # fmt: skip
    return config, {k.format(arch=arch): v for k, v in meta.items()}


def _lfm2_hf(model, config: dict) -> dict[str, np.ndarray]:
    """LFM2's weights as HF ships them: conv (C, 1, K), the MLPs w1/w3/w2, experts one by one,
    a (random, so routing shows it) expert_bias."""
    rng = np.random.default_rng(3)
    hf = {}
    for name, w in tree_flatten(model.parameters()):
        x = np.array(w, dtype=np.float32)
        if name.endswith("conv.conv.weight"):
            x = x.transpose(0, 2, 1)
        for mine, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            name = name.replace(f".{mine}.", f".{theirs}.")
        if name.endswith("expert_bias"):
            x = rng.normal(size=x.shape).astype(np.float32) * 0.5
        if ".switch_mlp." in name:
            for e in range(x.shape[0]):
                hf[name.replace("switch_mlp.", f"experts.{e}.")] = x[e]
        else:
            hf[name] = x
    return hf


_LFM2_EXPERT = r"model\.layers\.(\d+)\.feed_forward\.experts\.\d+\.(w\d)\.weight"


def _lfm2_converted(arch: str, hf: dict[str, np.ndarray]):
    """(GGUF name, tensor, HF name) as LFM2Model/LFM2MoeModel write them."""
    tmap = _tensor_map(arch)
    experts: dict[str, list] = {}
    for name, x in hf.items():
        src = name
        if "conv.conv" in name:  # LFM2Model.modify_tensors: "conv op requires 2d tensor"
            x = x.squeeze(1)
        if name.endswith(".expert_bias"):  # LFM2MoeModel.filter_tensors
            name += ".bias"
        if m := re.fullmatch(_LFM2_EXPERT, name):
            # LFM2MoeModel.modify_tensors: the experts stacked, named without "model."
            key = f"layers.{m.group(1)}.feed_forward.experts.{m.group(2)}.weight"
            experts.setdefault(key, []).append(x)
            if len(experts[key]) == NE:
                yield tmap.get_name(key, (".weight",)), np.stack(experts.pop(key)), src
            continue
        yield tmap.get_name(name, (".weight", ".bias")), x, src


# ------------------------------------------------------- Granite 4 (Mamba 2 + attention, MoE)
GRANITE_TYPES = ["mamba", "attention", "mamba", "mamba"]
NH, DH, NG, DS = 4, 32, 2, 16  # Mamba heads, head dim, groups, state


def _granite_config(arch: str, vocab: int) -> tuple[dict, dict]:
    """(mlx-lm config as HF's, GGUF metadata as GraniteHybridModel.set_gguf_parameters writes
    it). With RoPE (as Bamba, and the rope.scaling.finetuned flag) so q/k's permutation shows."""
    config = dict(model_type="granitemoehybrid", vocab_size=vocab, hidden_size=64,
                  intermediate_size=32, num_hidden_layers=4, max_position_embeddings=512,
                  num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
                  embedding_multiplier=3.0, attention_multiplier=0.2, logits_scaling=4.0,
                  residual_multiplier=0.5, layer_types=GRANITE_TYPES, rms_norm_eps=1e-5,
                  num_local_experts=NE, num_experts_per_tok=2, shared_intermediate_size=64,
                  mamba_n_heads=NH, mamba_d_head=DH, mamba_proj_bias=False, mamba_d_state=DS,
                  mamba_d_conv=4, mamba_n_groups=NG, mamba_conv_bias=True,
                  position_embedding_type="rope", rope_theta=10000.0,
                  tie_word_embeddings=True)  # fmt: skip
    K = gguf.Keys
    meta = {
        K.LLM.CONTEXT_LENGTH: 512, K.LLM.EMBEDDING_LENGTH: 64, K.LLM.BLOCK_COUNT: 4,
        K.LLM.FEED_FORWARD_LENGTH: 32, K.Attention.HEAD_COUNT: 4,
        K.Attention.HEAD_COUNT_KV: [2 if t == "attention" else 0 for t in GRANITE_TYPES],
        K.Attention.LAYERNORM_RMS_EPS: 1e-5, K.Rope.FREQ_BASE: 10000.0,
        K.Attention.SCALE: 0.2, K.LLM.EMBEDDING_SCALE: 3.0, K.LLM.RESIDUAL_SCALE: 0.5,
        K.LLM.LOGIT_SCALE: 4.0, K.LLM.EXPERT_COUNT: NE, K.LLM.EXPERT_USED_COUNT: 2,
        K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: 64, K.SSM.CONV_KERNEL: 4,
        K.SSM.STATE_SIZE: DS, K.SSM.GROUP_COUNT: NG, K.SSM.INNER_SIZE: NH * DH,
        K.SSM.TIME_STEP_RANK: NH, K.Rope.SCALING_FINETUNED: True,
    }  # fmt: skip
    return config, {k.format(arch=arch): v for k, v in meta.items()}


def _granite_hf(model, config: dict) -> dict[str, np.ndarray]:
    """Granite 4's weights as HF ships them: conv1d (C, 1, K), the experts' gate and up fused
    in block_sparse_moe.input_linear, their down as output_linear. The 1-D weights mlx-lm
    starts as constants (norms, A_log, D, dt_bias) made random so each shows."""
    rng = np.random.default_rng(4)
    params = {k: np.array(w, dtype=np.float32) for k, w in tree_flatten(model.parameters())}
    hf = {}
    for name, x in params.items():
        if x.ndim == 1 and not name.endswith("conv1d.bias"):
            x = x + rng.normal(size=x.shape).astype(np.float32) * 0.3
        if name.endswith("conv1d.weight"):
            x = x.transpose(0, 2, 1)
        if ".switch_mlp.gate_proj." in name:
            up = params[name.replace("gate_proj", "up_proj")]
            x = np.concatenate([x, up], axis=-2)
            name = name.replace("switch_mlp.gate_proj", "input_linear")
        elif ".switch_mlp.down_proj." in name:
            name = name.replace("switch_mlp.down_proj", "output_linear")
        elif ".switch_mlp." in name:
            continue
        hf[name] = x
    return hf


def _permute(x: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py, LlamaModel.permute."""
    shape = x.shape
    return x.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _granite_converted(arch: str, hf: dict[str, np.ndarray]):
    """(GGUF name, tensor, HF name) as GraniteHybridModel writes them (MoE: has_experts)."""
    tmap, T = _tensor_map(arch), gguf.MODEL_TENSOR
    for name, x in hf.items():
        src, bid = name, int(name.split(".")[2]) if name.startswith("model.layers.") else None
        fused = {
            "block_sparse_moe.input_linear.weight": (T.FFN_GATE_EXP, T.FFN_UP_EXP),
            "shared_mlp.input_linear.weight": (T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP),
        }
        if parts := next((v for k, v in fused.items() if name.endswith(k)), None):
            # GraniteMoeModel.modify_tensors: gate and up split apart
            for t, half in zip(parts, np.split(x, 2, axis=-2), strict=True):
                yield gguf.TENSOR_NAMES[t].format(bid=bid) + ".weight", half, src
            continue
        if bid is not None and GRANITE_TYPES[bid] == "mamba":  # Mamba2Model
            name = name.replace(".dt_bias", ".dt_proj.bias")  # filter_tensors
            new = tmap.get_name(name, (".weight", ".bias"))
            if new.endswith("ssm_conv1d.weight"):
                x = x.squeeze()
            elif new.endswith(("ssm_a", "ssm_d")):
                x = x.reshape(*x.shape, 1)
            elif new.endswith("ssm_norm.weight"):
                x = x.reshape(NG, NH * DH // NG)
            if name.endswith(".A_log"):
                x = -np.exp(x)
            yield new, x, src
            continue
        if name.endswith(("q_proj.weight", "q_proj.bias")):  # LlamaModel, undo_permute
            x = _permute(x, 4)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            x = _permute(x, 2)
        yield tmap.get_name(name, (".weight", ".bias")), x, src


# ------------------------------------------- Mamba 2, Nemotron-H (Mamba-2, attention, MLP)
NEMOTRON_PATTERN = "M*-M"  # Mamba-2, attention, ReLU^2 MLP, Mamba-2


def _backbone_config(arch: str, vocab: int) -> tuple[dict, dict]:
    """(mlx-lm config as HF's, GGUF metadata as Mamba2Model/NemotronHModel
    .set_gguf_parameters write it). Mamba 2: d_inner = 2 x hidden (the converter asserts it),
    one group (mlx-lm's norm), a tied head. Nemotron-H: two groups so the per-group norm shows;
    head_count_kv and feed_forward_length per layer (0 where the layer has none)."""
    K = gguf.Keys
    meta = {
        K.LLM.EMBEDDING_LENGTH: 64, K.LLM.BLOCK_COUNT: 4, K.Attention.LAYERNORM_RMS_EPS: 1e-5,
        K.SSM.CONV_KERNEL: 4, K.SSM.STATE_SIZE: DS, K.SSM.INNER_SIZE: 8 * 16,
        K.SSM.TIME_STEP_RANK: 8, K.LLM.CONTEXT_LENGTH: 2**20,
    }  # fmt: skip
    if arch == "mamba2":
        config = dict(model_type="mamba2", vocab_size=vocab, hidden_size=64,
                      intermediate_size=128, num_heads=8, head_dim=16, state_size=DS,
                      num_hidden_layers=4, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1,
                      use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                      time_step_limit=(0.0, float("inf")), time_step_rank=8)  # fmt: skip
        meta |= {K.LLM.FEED_FORWARD_LENGTH: 0, K.Attention.HEAD_COUNT: 0, K.SSM.GROUP_COUNT: 1}
    else:
        config = dict(model_type="nemotron_h", vocab_size=vocab, hidden_size=64,
                      intermediate_size=96, num_hidden_layers=4, max_position_embeddings=512,
                      num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, attention_bias=False,
                      mamba_num_heads=8, mamba_head_dim=16, mamba_proj_bias=False,
                      ssm_state_size=DS, conv_kernel=4, n_groups=NG, mlp_bias=False,
                      layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                      hybrid_override_pattern=NEMOTRON_PATTERN)  # fmt: skip
        meta |= {
            K.Attention.HEAD_COUNT: 4, K.Attention.KEY_LENGTH: 16, K.Attention.VALUE_LENGTH: 16,
            K.Attention.HEAD_COUNT_KV: [2 if t == "*" else 0 for t in NEMOTRON_PATTERN],
            K.LLM.FEED_FORWARD_LENGTH: [96 if t == "-" else 0 for t in NEMOTRON_PATTERN],
            K.SSM.GROUP_COUNT: NG, K.Rope.SCALING_FINETUNED: False,
        }  # fmt: skip
    return config, {k.format(arch=arch): v for k, v in meta.items()}


def _backbone_hf(model, config: dict) -> dict[str, np.ndarray]:
    """Mamba 2's and Nemotron-H's weights as HF ships them (mlx-lm's names, conv1d
    (C, 1, K)); the 1-D weights mlx-lm starts as constants made random so each shows."""
    rng = np.random.default_rng(5)
    hf = {}
    for name, w in tree_flatten(model.parameters()):
        x = np.array(w, dtype=np.float32)
        if x.ndim == 1 and not name.endswith("conv1d.bias"):
            x = x + rng.normal(size=x.shape).astype(np.float32) * 0.3
        if name.endswith("conv1d.weight"):
            x = x.transpose(0, 2, 1)
        hf[name] = x
    return hf


def _mamba2_tensor(new: str, name: str, x: np.ndarray, groups: int) -> np.ndarray:
    """convert_hf_to_gguf.py, Mamba2Model.modify_tensors on one Mamba-2 tensor."""
    if new.endswith("ssm_conv1d.weight"):
        x = x.squeeze()
    elif new.endswith(("ssm_a", "ssm_d")):
        x = x.reshape(*x.shape, 1)
    elif new.endswith("ssm_norm.weight"):
        x = x.reshape(groups, -1)
    return -np.exp(x) if name.endswith(".A_log") else x


def _backbone_converted(arch: str, hf: dict[str, np.ndarray]):
    """(GGUF name, tensor, HF name) as Mamba2Model / NemotronHModel write them: Nemotron-H's
    Mamba-2 layers through Mamba2Model, its attention through LlamaModel (undo_permute, from
    GraniteHybridModel), its MLP layers and the rest unchanged (ModelBase)."""
    tmap = _tensor_map(arch)
    pattern = NEMOTRON_PATTERN if arch == "nemotron_h" else "MMMM"
    for name, x in hf.items():
        src, bid = name, int(name.split(".")[2]) if name.startswith("backbone.layers.") else None
        name = name.replace(".dt_bias", ".dt_proj.bias")  # Mamba2Model.filter_tensors
        new = tmap.get_name(name, (".weight", ".bias"))
        if bid is not None and pattern[bid] == "M":
            x = _mamba2_tensor(new, name, x, NG if arch == "nemotron_h" else 1)
        elif name.endswith(("q_proj.weight", "q_proj.bias")):
            x = _permute(x, 4)
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            x = _permute(x, 2)
        yield new, x, src


# ------------------------------------------------------------ writing any hybrid's GGUF
HYBRIDS |= {"lfm2": "lfm2", "lfm2moe": "lfm2_moe", "granitehybrid": "granitemoehybrid"}
HYBRIDS |= {"mamba2": "mamba2", "nemotron_h": "nemotron_h"}
_WRITERS = {  # arch -> (config and metadata, HF weights, the converter's changes)
    **dict.fromkeys(("qwen35", "qwen35moe", "qwen3next"),
                    (_hybrid_config, _hf_weights, _converted)),
    **dict.fromkeys(("lfm2", "lfm2moe"), (_lfm2_config, _lfm2_hf, _lfm2_converted)),
    "granitehybrid": (_granite_config, _granite_hf, _granite_converted),
    **dict.fromkeys(("mamba2", "nemotron_h"),
                    (_backbone_config, _backbone_hf, _backbone_converted)),
}  # fmt: skip
KINDS_OF = {"lfm2": ["recurrent", "recurrent", "full", "recurrent"]}
KINDS_OF |= {
    "lfm2moe": KINDS_OF["lfm2"],
    "granitehybrid": ["recurrent", "full"] + ["recurrent"] * 2,
    "mamba2": ["recurrent"] * 4,
    "nemotron_h": ["recurrent", "full", "none", "recurrent"],  # M * - M
}


def write_tiny_hybrid(tmp_path, arch: str, mtp: bool = False):
    """(path of the GGUF, the reference mlx-lm model holding the same rounded weights); with
    ``mtp`` an MTP block bundled as llama.cpp's converter does for Qwen3.5 (_Qwen35MtpMixin):
    counted in block_count, nextn_predict_layers set, its tensors as the next blk.N.*."""
    tok = tiny_tokenizer()
    config_of, hf_of, converted = _WRITERS[arch]
    config, meta = config_of(arch, len(tok))
    n = config["num_hidden_layers"]
    if mtp:
        meta[f"{arch}.block_count"] = n + 1
        meta[gguf.Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch)] = 1
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(7)
    model = module.Model(module.ModelArgs.from_dict(config))
    hf = hf_of(model, config)
    rounded = {}
    for name, x in hf.items():
        kind = _kind(arch, name, x)
        data = gguf.quants.quantize(x, kind) if kind != Q.F32 else x
        rounded[name] = mx.array(gguf.quants.dequantize(data, kind).reshape(x.shape))
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for k, v in {**meta, **tokenizer_meta(tok)}.items():
        _add(writer, k, v)
    for gname, x, src in converted(arch, hf):
        kind = _kind(arch, src, hf[src])
        x = np.ascontiguousarray(x, dtype=np.float32)
        writer.add_tensor(gname, gguf.quants.quantize(x, kind) if kind != Q.F32 else x,
                          raw_dtype=kind)  # fmt: skip
    T, N = gguf.MODEL_TENSOR, gguf.TENSOR_NAMES
    mtp_tensors = [(T.NEXTN_EH_PROJ, (64, 128)), (T.NEXTN_ENORM, (64,)), (T.ATTN_NORM, (64,))]
    for t, shape in mtp_tensors if mtp else []:
        writer.add_tensor(N[t].format(bid=n) + ".weight", np.ones(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = module.Model(module.ModelArgs.from_dict(config))
    ref.load_weights(list(ref.sanitize(rounded).items()), strict=True)  # mlx-lm's HF path
    mx.eval(ref.parameters())
    return path, ref


@pytest.mark.parametrize("arch", list(HYBRIDS))
def test_each_hybrid_gguf_loads_the_weights_it_was_written_with(tmp_path, arch):
    path, ref = write_tiny_hybrid(tmp_path, arch)
    model, tokenizer, config = load_gguf(path, mx.float32, keep_quantized=False)
    assert config["model_type"] == HYBRIDS[arch]
    kinds = KINDS_OF.get(arch, ["recurrent", "full"] * 2)
    assert layer_kinds(config) == kinds  # the memory plan reads these
    assert kv_bytes(config, 64, 4) > 0
    _computes_as(model, ref, tokenizer)


def test_a_qwen35_gguf_with_its_mtp_block_bundled_loads_the_model_without_it(tmp_path):
    """llama.cpp's converter bundles Qwen3.5's MTP head by default: its block is not a layer."""
    path, ref = write_tiny_hybrid(tmp_path, "qwen35", mtp=True)
    model, tokenizer, config = load_gguf(path, mx.float32, keep_quantized=False)
    assert config["num_hidden_layers"] == 4
    _computes_as(model, ref, tokenizer)


def test_gguf_weights_mlx_lm_keeps_in_float32_stay_float32(tmp_path):
    """Qwen3.5's A_log is undone from float32 and kept there at a bfloat16 load (mlx-lm's
    cast_predicate), the rest cast."""
    path, _ = write_tiny_hybrid(tmp_path, "qwen35")
    model, _, _ = load_gguf(path, mx.bfloat16, keep_quantized=False)
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    a_log = [k for k in dtypes if k.endswith("A_log")]
    assert a_log and all(dtypes[k] == mx.float32 for k in a_log)
    assert dtypes["language_model.model.embed_tokens.weight"] == mx.bfloat16
    # and load_model's cast to the spec's dtype keeps them too
    _set_dtype(model, mx.float16)
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    assert all(dtypes[k] == mx.float32 for k in a_log)
    assert dtypes["language_model.model.embed_tokens.weight"] == mx.float16


def test_a_granite4_gguf_rotating_part_of_each_head_is_refused(tmp_path):
    """Bamba-style files rotate rope.dimension_count < head_dim: mlx-lm's model cannot."""
    _, meta = _WRITERS["granitehybrid"][0]("granitehybrid", 32)
    meta = {**meta, "granitehybrid.rope.scaling.finetuned": True,
            "granitehybrid.rope.dimension_count": 8}  # fmt: skip
    tensors = {"token_embd.weight": ("F32", (32, 64))}
    with pytest.raises(ModelLoadError, match="part of each head"):
        gguf_config({"general.architecture": "granitehybrid", **meta}, tensors, tmp_path / "x")


def test_a_qwen35_gguf_without_the_v_heads_regrouped_differs(tmp_path, monkeypatch):
    """The check sees llama.cpp's V-head reorder: undoing only the rest gives other logits."""
    path, ref = write_tiny_hybrid(tmp_path, "qwen35")
    monkeypatch.setitem(ARCHS, "qwen35", replace(ARCHS["qwen35"], undo=_undo_gated_delta))
    model, _, _ = load_gguf(path, mx.float32, keep_quantized=False)
    x = mx.array([[3, 4, 5, 6]])
    assert not mx.allclose(model(x), ref(x), atol=1e-2)


def test_a_granite4_gguf_without_q_k_unpermuted_differs(tmp_path, monkeypatch):
    """The check sees LlamaModel.permute on Granite's q/k: left as stored, RoPE turns them
    differently and the logits past the first token differ."""
    path, ref = write_tiny_hybrid(tmp_path, "granitehybrid")
    monkeypatch.setattr(specmlx.models.gguf_hybrids, "_unpermute", lambda w, heads: w)
    model, _, _ = load_gguf(path, mx.float32, keep_quantized=False)
    x = mx.array([[3, 4, 5, 6]])
    assert not mx.allclose(model(x), ref(x), atol=1e-2)


def test_a_mamba2_gguf_with_several_groups_is_refused(tmp_path):
    """llama.cpp normalizes Mamba 2's gated output per group, mlx-lm's mamba2 over all of it:
    with more than one group they would compute differently."""
    _, meta = _WRITERS["mamba2"][0]("mamba2", 32)
    meta = {**meta, "mamba2.ssm.group_count": 8}
    tensors = {"token_embd.weight": ("F32", (32, 64))}
    with pytest.raises(ModelLoadError, match="8 groups"):
        gguf_config({"general.architecture": "mamba2", **meta}, tensors, tmp_path / "x")
