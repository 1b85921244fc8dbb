"""The hybrid and recurrent llama.cpp architectures specmlx loads, as `Arch` entries (see
gguf_archs.py): the gated-delta hybrids qwen35, qwen35moe, qwen3next; LFM2's short-conv
hybrids lfm2, lfm2moe; the Mamba-2 models mamba2, Granite 4's granitehybrid, nemotron_h.

Where llama.cpp's convert_hf_to_gguf.py changed a tensor on writing (A stored as
-exp(A_log), conv1d squeezed, Qwen3.5's V heads regrouped, Qwen3-Next's q/k/v/z regrouped;
Mamba-2's A and D reshaped (H, 1), its norm (groups, d_inner / groups); Granite's and
Nemotron-H's q/k permuted, Granite's shared expert split), each family's undo puts it back
into mlx-lm's own layout. Which layers are attention: every full_attention_interval-th for
the gated-delta hybrids, else those with a per-layer head_count_kv above 0 (Nemotron-H's
MLP-only layers: a per-layer feed_forward_length above 0)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from ..errors import ModelLoadError
from .gguf_archs import BLOCK_NAMES, QK_NORMS, TOP_NAMES, Arch, per_layer

_GATED_DELTA_NAMES = {
    **{k: v for k, v in BLOCK_NAMES.items() if k != "ffn_norm"}, **QK_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
    "ssm_ba": "linear_attn.in_proj_ba", "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "ffn_gate_up_exps": "mlp.switch_mlp.gate_up_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}  # fmt: skip


def _heads(config: dict) -> tuple[int, ...]:
    """A gated-delta layer's (key heads, value heads, key head dim, value head dim)."""
    keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim")  # fmt: skip
    return tuple(config[k] for k in keys)


def _ungroup_v(x: mx.array, axis: int, nk: int, nv: int, dim: int) -> mx.array:
    """Qwen3.5's V heads back from llama.cpp's tiled order ([k0 k1 .., k0 k1 ..]) to HF's,
    grouped by key head (the inverse of convert_hf_to_gguf.py's
    _LinearAttentionVReorderBase._reorder_v_heads) along ``axis``."""
    axis %= x.ndim
    shape = list(x.shape)
    x = x.reshape(*shape[:axis], nv // nk, nk, dim, *shape[axis + 1 :])
    return mx.swapaxes(x, axis, axis + 1).reshape(shape)


def _undo_gated_delta(weights: dict, config: dict) -> dict:
    """Qwen3-Next and Qwen3.5 (convert_hf_to_gguf.py, Qwen3NextModel.modify_tensors): A was
    written as -exp(A_log), dt_bias renamed dt_proj.bias (named above), conv1d (C, 1, K)
    squeezed to (C, K): mlx-lm's Conv1d is (C, K, 1). The norms were written + 1 (all but
    linear_attn.norm), which is mlx-lm's own form: with its conv1d as (C, K, 1), mlx-lm's
    sanitize takes the weights as its own and shifts nothing. MoE: llama.cpp's fused
    ffn_gate_up_exps is gate then up ({n_embd, 2 n_ff_exp, n_expert}), the shared expert's gate
    may be 1-D ({n_embd})."""
    for k in list(weights):
        w = weights[k]
        if k.endswith(".A_log"):
            weights[k] = mx.log(-w)
        elif k.endswith(".conv1d.weight") and w.ndim == 2:
            weights[k] = w[..., None]
        elif k.endswith(".shared_expert_gate.weight"):
            weights[k] = w.reshape(1, -1)
        elif k.endswith(".gate_up_proj.weight"):
            base = k[: -len(".gate_up_proj.weight")]
            gate, up = mx.split(weights.pop(k), 2, axis=-2)
            weights[f"{base}.gate_proj.weight"], weights[f"{base}.up_proj.weight"] = gate, up
    return weights


def _undo_qwen35(weights: dict, config: dict) -> dict:
    """Qwen3.5: besides the gated-delta changes, the converter reorders the V heads from
    grouped-by-key-head to tiled when there are more value heads than key heads
    (_LinearAttentionVReorderBase.modify_tensors): rows of in_proj_qkv's V part, of
    in_proj_z, in_proj_a, in_proj_b; A_log, dt_bias; conv1d's V channels; out_proj's columns."""
    weights = _undo_gated_delta(weights, config)
    nk, nv, dk, dv = _heads(config)
    if nk == nv:
        return weights
    for k in list(weights):
        w, part = weights[k], k.rpartition("linear_attn.")[2]
        if part in ("in_proj_qkv.weight", "conv1d.weight"):
            qk, v = w[: 2 * nk * dk], w[2 * nk * dk :]
            weights[k] = mx.concatenate([qk, _ungroup_v(v, 0, nk, nv, dv)])
        elif part == "in_proj_z.weight":
            weights[k] = _ungroup_v(w, 0, nk, nv, dv)
        elif part in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
            weights[k] = _ungroup_v(w, 0, nk, nv, 1)
        elif part == "out_proj.weight":
            weights[k] = _ungroup_v(w, 1, nk, nv, dv)
    return weights


def _undo_qwen3next(weights: dict, config: dict) -> dict:
    """Qwen3-Next: besides the gated-delta changes, the converter split HF's in_proj_qkvz
    ([q k v z] per key head) into attn_qkv ([q.. k.. v..]) and attn_gate ([z..])
    (Qwen3NextModel.modify_tensors); mlx-lm keeps HF's in_proj_qkvz, so it is rebuilt. A
    legacy file's ssm_in is HF's in_proj_qkvz as it was (llama.cpp's legacy build_qkvz path)."""
    weights = _undo_gated_delta(weights, config)
    nk, nv, dk, dv = _heads(config)
    for k in [k for k in weights if k.endswith(".linear_attn.in_proj_qkv.weight")]:
        base = k[: -len("in_proj_qkv.weight")]
        qkv, z = weights.pop(k), weights.pop(f"{base}in_proj_z.weight")
        q, kk, v = mx.split(qkv, [nk * dk, 2 * nk * dk])
        parts = [t.reshape(nk, -1, t.shape[-1]) for t in (q, kk, v, z)]
        qkvz = mx.concatenate(parts, axis=1)  # (key heads, [q k v z], in)
        weights[f"{base}in_proj_qkvz.weight"] = qkvz.reshape(-1, qkv.shape[-1])
    return weights


_LFM2_NAMES = {
    "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm", "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
}  # fmt: skip
_LFM2MOE_NAMES = {
    **_LFM2_NAMES, "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj", "ffn_gate_inp": "feed_forward.gate",
    "ffn_gate_exps": "feed_forward.switch_mlp.gate_proj",
    "ffn_up_exps": "feed_forward.switch_mlp.up_proj",
    "ffn_down_exps": "feed_forward.switch_mlp.down_proj",
    "exp_probs_b.bias": "feed_forward.expert_bias",
}  # fmt: skip
# LFM2's final norm is llama.cpp's token_embd_norm (LLM_TENSOR_OUTPUT_NORM_LFM2), HF's
# embedding_norm; the head is always the tied embedding in mlx-lm
_LFM2_TOP = {"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm"}


def _undo_lfm2(weights: dict, config: dict) -> dict:
    """LFM2 (convert_hf_to_gguf.py, LFM2Model/LFM2MoeModel.modify_tensors): the short conv
    (C, 1, K) squeezed to (C, K); mlx-lm's Conv1d is (C, K, 1), which its sanitize keeps as
    its own (it transposes only a last axis longer than the second, HF's (C, 1, K)). The
    experts came stacked (experts, out, in), mlx-lm's SwitchGLU layout."""
    for k, w in weights.items():
        if k.endswith(".conv.conv.weight") and w.ndim == 2:
            weights[k] = w[..., None]
    return weights


def _mamba2_names(mixer: str) -> dict[str, str]:
    """A Mamba-2 mixer's tensors (mlx-lm keeps them under ``mixer``): A_log and D by whole
    name (llama.cpp's ssm_a, ssm_d have no leaf), dt_bias written as dt_proj.bias."""
    return {
        "ssm_in": f"{mixer}.in_proj", "ssm_out": f"{mixer}.out_proj",
        "ssm_conv1d": f"{mixer}.conv1d", "ssm_dt.bias": f"{mixer}.dt_bias",
        "ssm_a": f"{mixer}.A_log", "ssm_d": f"{mixer}.D", "ssm_norm": f"{mixer}.norm",
    }  # fmt: skip


def _undo_mamba2(weights: dict, mixer: str) -> dict:
    """convert_hf_to_gguf.py, Mamba2Model.modify_tensors: conv1d (C, 1, K) squeezed to (C, K)
    (mlx-lm's Conv1d is (C, K, 1), which its sanitize keeps: it moves axes only when the last
    is not 1); A_log (H,) written as -exp(A_log) and reshaped (H, 1), D reshaped (H, 1); the
    gated norm (d_inner,) reshaped (n_group, d_inner / n_group)."""
    for k, w in weights.items():
        if f".{mixer}." not in k:
            continue
        if k.endswith(".A_log"):
            weights[k] = mx.log(-w).reshape(-1)
        elif k.endswith((".D", ".norm.weight")):
            weights[k] = w.reshape(-1)
        elif k.endswith(".conv1d.weight") and w.ndim == 2:
            weights[k] = w[..., None]
    return weights


def _unpermute(w: mx.array, heads: int) -> mx.array:
    """The inverse of convert_hf_to_gguf.py's LlamaModel.permute (q/k rows per head from HF's
    rotate-half order to llama.cpp's interleaved one), along axis 0."""
    shape = w.shape
    w = w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:])
    return mx.swapaxes(w, 1, 2).reshape(shape)


def _unpermute_qk(weights: dict, config: dict, under: str) -> dict:
    """LlamaModel.permute undone on every q_proj/k_proj tensor found after ``under`` (weight,
    bias and any kept scales alike)."""
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for k in list(weights):
        if (proj := k.rpartition(".")[0].rpartition(under)[2]) in heads:
            weights[k] = _unpermute(weights[k], heads[proj])
    return weights


def _undo_granite_hybrid(weights: dict, config: dict) -> dict:
    """Granite 4 (convert_hf_to_gguf.py, GraniteHybridModel.modify_tensors): Mamba-2 layers as
    Mamba2Model writes them; attention layers through LlamaModel.modify_tensors, which permutes
    q/k (undo_permute = True) though Granite 4 has no RoPE (undone all the same: rows of the
    weight, bias and any kept scales alike); GraniteMoeModel split HF's fused
    shared_mlp.input_linear into the shared expert's gate and up, mlx-lm's fused form here."""
    weights = _unpermute_qk(_undo_mamba2(weights, "mamba"), config, "self_attn.")
    for k in list(weights):
        base, _, leaf = k.rpartition(".")
        if base.endswith("shared_mlp.gate"):
            up = weights.pop(f"{base[: -len('gate')]}up.{leaf}")
            weights[f"{base[: -len('gate')]}input_linear.{leaf}"] = mx.concatenate(
                [weights.pop(k), up]
            )
    return weights


_GRANITE_HYBRID_NAMES = {
    **BLOCK_NAMES, **_mamba2_names("mamba"),
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.switch_mlp.gate_proj",
    "ffn_up_exps": "block_sparse_moe.switch_mlp.up_proj",
    "ffn_down_exps": "block_sparse_moe.switch_mlp.down_proj",
    "ffn_gate_shexp": "shared_mlp.gate", "ffn_up_shexp": "shared_mlp.up",  # fused on load
    "ffn_down_shexp": "shared_mlp.output_linear",
}  # fmt: skip
# Mamba 2 and Nemotron-H keep their blocks as backbone.layers.N.{norm, mixer}: one norm before
# whatever the layer's mixer is (Mamba-2, attention, or Nemotron-H's ReLU^2 MLP)
_BACKBONE_TOP = {"token_embd": "backbone.embeddings", "output_norm": "backbone.norm_f",
                 "output": "lm_head"}  # fmt: skip
_MAMBA2_NAMES = {"attn_norm": "norm", **_mamba2_names("mixer")}
_NEMOTRON_H_NAMES = {
    **_MAMBA2_NAMES, "attn_q": "mixer.q_proj", "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj", "attn_output": "mixer.o_proj", "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
}  # fmt: skip


def _undo_mamba2_model(weights: dict, config: dict) -> dict:
    """Mamba 2 (convert_hf_to_gguf.py, Mamba2Model.modify_tensors): its mixers' changes."""
    return _undo_mamba2(weights, "mixer")


def _undo_nemotron_h(weights: dict, config: dict) -> dict:
    """Nemotron-H (convert_hf_to_gguf.py, NemotronHModel, a GraniteHybridModel): Mamba-2 layers
    as Mamba2Model writes them; attention layers through LlamaModel.modify_tensors with the
    inherited undo_permute, so q/k permuted though Nemotron-H has no RoPE (the scores are the
    same either way: undone to HF's rows all the same); MLP layers as they were."""
    return _unpermute_qk(_undo_mamba2(weights, "mixer"), config, "mixer.")


def _gated_delta_config(get: Callable, tensors: dict, config: dict, path: Path) -> dict:
    """The gated-delta fields, from the keys Qwen3NextModel.set_gguf_parameters writes:
    ssm.state_size is the key head dim, ssm.group_count the key heads, ssm.time_step_rank the
    value heads, ssm.inner_size value heads x value head dim; rope.dimension_count the rotated
    dims (head_dim x partial_rotary_factor)."""
    nv, n = get("ssm.time_step_rank"), config["num_hidden_layers"]
    every = get("full_attention_interval", 4)  # llama.cpp's default too
    rotated = get("rope.dimension_count", config["head_dim"]) / config["head_dim"]
    out = {
        "linear_num_key_heads": get("ssm.group_count"), "linear_num_value_heads": nv,
        "linear_key_head_dim": get("ssm.state_size"),
        "linear_value_head_dim": get("ssm.inner_size") // nv,
        "linear_conv_kernel_dim": get("ssm.conv_kernel"), "full_attention_interval": every,
        "partial_rotary_factor": rotated,
        # mlx-lm's qwen3_5 reads RoPE from rope_parameters; text positions make M-RoPE plain
        "rope_parameters": {"type": "default", "rope_theta": config["rope_theta"],
                            "partial_rotary_factor": rotated},
    }  # fmt: skip
    if get("expert_count"):  # llama.cpp renormalizes the top-k weights (build_moe_ffn, norm_w)
        out |= {
            "num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(n)
                                if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
        }  # fmt: skip
    return out


def _lfm2_config(get: Callable, tensors: dict, config: dict, path: Path) -> dict:
    """The LFM2 fields, from the keys LFM2Model/LFM2MoeModel.set_gguf_parameters write:
    head_count_kv per layer, 0 on a short-conv layer (llama.cpp's is_recr); shortconv.l_cache
    the conv kernel; feed_forward_length the dense width already adjusted
    (LFM2Model._add_feed_forward_length), so mlx-lm adjusts nothing."""
    kv = per_layer(get("attention.head_count_kv", config["num_attention_heads"]))
    n = config["num_hidden_layers"]
    if len(kv) == 1:
        raise ModelLoadError(f"{path}: an LFM2 GGUF needs head_count_kv per layer")
    if get("attention.sliding_window", 0):  # LFM2.5's windowed attention: not in mlx-lm
        raise ModelLoadError(f"{path}: LFM2 with a sliding window is not supported")
    out = {
        "norm_eps": config["rms_norm_eps"], "conv_L_cache": get("shortconv.l_cache"),
        "conv_bias": any(k.endswith("shortconv.in_proj.bias") for k in tensors),
        "full_attn_idxs": [i for i in range(n) if kv[i] > 0],
        "block_dim": config["hidden_size"], "block_ff_dim": config["intermediate_size"],
        "block_auto_adjust_ff_dim": False, "block_multiple_of": 1,
        "block_ffn_dim_multiplier": 1.0, "tie_word_embeddings": True,
    }  # fmt: skip
    if get("expert_count"):
        if get("expert_gating_func", 2) != 2:  # mlx-lm's lfm2_moe routes by sigmoid only
            raise ModelLoadError(f"{path}: LFM2-MoE gating other than sigmoid")
        # llama.cpp's LFM2 graph renormalizes the top-k weights (build_moe_ffn, norm_w)
        # and never scales them (scale_w false)
        out |= {
            "num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length"),
            "num_dense_layers": get("leading_dense_block_count", 0), "norm_topk_prob": True,
            "use_expert_bias": any(k.endswith("exp_probs_b.bias") for k in tensors),
            "routed_scaling_factor": 1.0,
        }  # fmt: skip
    return out


def _mamba2_config(get: Callable, tensors: dict, mixer: str) -> dict:
    """A Mamba-2 mixer's fields as mlx-lm's hybrids name them (mamba_*), from the ssm.* keys:
    time_step_rank the heads, inner_size heads x head dim, group_count the B/C groups."""
    heads = get("ssm.time_step_rank")
    return {
        "mamba_n_heads": heads, "mamba_d_head": get("ssm.inner_size") // heads,
        "mamba_d_state": get("ssm.state_size"), "mamba_d_conv": get("ssm.conv_kernel"),
        "mamba_n_groups": get("ssm.group_count"),
        "mamba_conv_bias": any(k.endswith("ssm_conv1d.bias") for k in tensors),
        "mamba_proj_bias": any(k.endswith("ssm_in.bias") for k in tensors),
    }  # fmt: skip


def _granite_hybrid_config(get: Callable, tensors: dict, config: dict, path: Path) -> dict:
    """Granite 4's fields, from the keys GraniteHybridModel.set_gguf_parameters writes:
    head_count_kv per layer (0 on a Mamba layer), Granite's scales (GraniteModel), RoPE only
    where rope.scaling.finetuned says so (llama.cpp's use_rope: Granite 4 has none)."""
    kv = per_layer(get("attention.head_count_kv", config["num_attention_heads"]))
    if len(kv) == 1:
        raise ModelLoadError(f"{path}: a Granite 4 GGUF needs head_count_kv per layer")
    rope = bool(get("rope.scaling.finetuned"))
    if rope and get("rope.dimension_count", config["head_dim"]) < config["head_dim"]:
        # Bamba-style files rotate part of each head; mlx-lm's model rotates all of it
        raise ModelLoadError(f"{path}: RoPE on part of each head is not supported for this model")
    out = {
        "layer_types": ["attention" if n else "mamba" for n in kv],
        "attention_bias": any(k.endswith("attn_q.bias") for k in tensors),
        "mlp_bias": any(k.endswith("ffn_gate.bias") for k in tensors),
        # llama.cpp's defaults where a scale is absent (0: 1/sqrt(head_dim), no scaling)
        "attention_multiplier": get("attention.scale") or config["head_dim"] ** -0.5,
        "embedding_multiplier": get("embedding_scale") or 1.0,
        "residual_multiplier": get("residual_scale") or 1.0,
        "logits_scaling": get("logit_scale") or 1.0,
        "position_embedding_type": "rope" if rope else "nope",
        **_mamba2_config(get, tensors, "mamba"),
    }  # fmt: skip
    if get("expert_count"):  # softmax over the top-k logits, as llama.cpp's norm_w gives
        out |= {
            "num_local_experts": get("expert_count"),
            "num_experts_per_tok": get("expert_used_count"),
            "shared_intermediate_size": get("expert_shared_feed_forward_length"),
        }  # fmt: skip
    return out


def _pure_mamba2_config(get: Callable, tensors: dict, config: dict, path: Path) -> dict:
    """Mamba 2's fields as mlx-lm's mamba2 names them, from the keys
    Mamba2Model.set_gguf_parameters writes. llama.cpp normalizes the gated output per group
    (ssm_norm {d_inner / n_group, n_group}), mlx-lm's mamba2 over all of d_inner: the two
    agree only with one group."""
    m = _mamba2_config(get, tensors, "mixer")
    if (groups := m["mamba_n_groups"]) != 1:
        raise ModelLoadError(f"{path}: a Mamba 2 GGUF with {groups} groups is not supported "
                             "(mlx-lm's mamba2 normalizes over all groups at once)")  # fmt: skip
    return {
        "num_heads": m["mamba_n_heads"], "head_dim": m["mamba_d_head"],
        "intermediate_size": get("ssm.inner_size"), "state_size": m["mamba_d_state"],
        "conv_kernel": m["mamba_d_conv"], "n_groups": 1, "use_bias": m["mamba_proj_bias"],
        "use_conv_bias": m["mamba_conv_bias"], "layer_norm_epsilon": config["rms_norm_eps"],
        "time_step_rank": m["mamba_n_heads"],
        "time_step_limit": (0.0, float("inf")),  # llama.cpp's ssm_scan clamps no dt
    }  # fmt: skip


def _nemotron_h_config(get: Callable, tensors: dict, config: dict, path: Path) -> dict:
    """Nemotron-H's fields, from the keys NemotronHModel.set_gguf_parameters writes:
    head_count_kv per layer (> 0 on attention), feed_forward_length per layer (> 0 on an MLP
    layer), neither on a Mamba-2 one (llama.cpp's is_recr); mlx-lm's hybrid_override_pattern
    rebuilt from them. mlx-lm's gated norm is per group (n_groups), as llama.cpp's."""
    kv = per_layer(get("attention.head_count_kv", 0))
    ff = per_layer(get("feed_forward_length", 0))
    n = config["num_hidden_layers"]
    if len(kv) != n or len(ff) != n:
        raise ModelLoadError(f"{path}: a Nemotron-H GGUF needs head_count_kv and "
                             "feed_forward_length per layer")  # fmt: skip
    if get("expert_count"):
        raise ModelLoadError(f"{path}: Nemotron-H with experts is not supported")
    scale = get("attention.scale") or config["head_dim"] ** -0.5  # llama.cpp's kq_scale
    if abs(scale - config["head_dim"] ** -0.5) > 1e-6:  # mlx-lm's is always 1/sqrt(head_dim)
        raise ModelLoadError(f"{path}: Nemotron-H with attention.scale {scale} is not supported")
    if "output.weight" not in tensors:  # mlx-lm's nemotron_h always has its own head
        raise ModelLoadError(f"{path}: a Nemotron-H GGUF without output.weight (tied head)")
    m = _mamba2_config(get, tensors, "mixer")
    pattern = ["*" if k else "-" if f else "M" for k, f in zip(kv, ff, strict=True)]
    return {
        "hybrid_override_pattern": pattern,  # M Mamba-2, * attention, - MLP
        "intermediate_size": max(ff), "layer_norm_epsilon": config["rms_norm_eps"],
        "attention_bias": any(k.endswith("attn_q.bias") for k in tensors),
        "mlp_bias": any(k.endswith("ffn_up.bias") for k in tensors),
        "mamba_num_heads": m["mamba_n_heads"], "mamba_head_dim": m["mamba_d_head"],
        "ssm_state_size": m["mamba_d_state"], "conv_kernel": m["mamba_d_conv"],
        "n_groups": m["mamba_n_groups"], "mamba_proj_bias": m["mamba_proj_bias"],
        "use_bias": m["mamba_proj_bias"], "use_conv_bias": m["mamba_conv_bias"],
        "time_step_limit": (0.0, float("inf")),  # llama.cpp's ssm_scan clamps no dt
    }  # fmt: skip


_SSM_KEYS = tuple(f"ssm.{k}" for k in ("conv_kernel", "state_size", "group_count",
                                         "time_step_rank", "inner_size"))  # fmt: skip
_GDN_TENSORS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
                "linear_attn.in_proj_b", "linear_attn.out_proj",
                "switch_mlp.gate_up_proj")  # fmt: skip
_QWEN35_TOP = {k: f"language_model.{v}" for k, v in TOP_NAMES.items()}
HYBRID_ARCHS = {
    # Qwen3.5 (dense and MoE) and Qwen3-Next: gated-delta layers, a full-attention one every
    # full_attention_interval-th; mlx-lm's qwen3_5 keeps the text model under language_model.
    # The norms come + 1 from the converter, which is mlx-lm's form already (see the undos).
    "qwen35": Arch("qwen3_5", _GATED_DELTA_NAMES, top=_QWEN35_TOP,
                   layers="language_model.model.layers", undo=_undo_qwen35,
                   rearranged=_GDN_TENSORS, needs=_SSM_KEYS, configure=_gated_delta_config),
    "qwen35moe": Arch("qwen3_5_moe", _GATED_DELTA_NAMES, top=_QWEN35_TOP,
                      layers="language_model.model.layers", undo=_undo_qwen35,
                      rearranged=_GDN_TENSORS, needs=_SSM_KEYS,
                      configure=_gated_delta_config),
    "qwen3next": Arch("qwen3_next", _GATED_DELTA_NAMES, undo=_undo_qwen3next,
                      rearranged=("linear_attn.in_proj_qkv", "linear_attn.in_proj_z",
                                  "switch_mlp.gate_up_proj"),
                      needs=_SSM_KEYS, configure=_gated_delta_config),
    # LFM2 (dense and MoE): short-convolution layers, attention where head_count_kv > 0;
    # LFM2-MoE's first leading_dense_block_count layers dense, the rest sigmoid-routed experts
    "lfm2": Arch("lfm2", _LFM2_NAMES, top=_LFM2_TOP, undo=_undo_lfm2,
                 needs=("shortconv.l_cache",), configure=_lfm2_config),
    "lfm2moe": Arch("lfm2_moe", _LFM2MOE_NAMES, top=_LFM2_TOP, undo=_undo_lfm2,
                    needs=("shortconv.l_cache",), configure=_lfm2_config),
    # Granite 4 (dense and MoE with a shared expert): Mamba-2 layers, attention where
    # head_count_kv > 0; Granite's embedding, residual, attention and logit scales
    "granitehybrid": Arch("granitemoehybrid", _GRANITE_HYBRID_NAMES,
                          undo=_undo_granite_hybrid,
                          rearranged=("shared_mlp.gate", "shared_mlp.up"),
                          needs=_SSM_KEYS, configure=_granite_hybrid_config),
    # Mamba 2: Mamba-2 layers only; Nemotron-H: Mamba-2, attention (no RoPE) where
    # head_count_kv > 0, and ReLU^2 MLP-only layers where feed_forward_length > 0
    "mamba2": Arch("mamba2", _MAMBA2_NAMES, top=_BACKBONE_TOP, layers="backbone.layers",
                   undo=_undo_mamba2_model, needs=_SSM_KEYS, configure=_pure_mamba2_config),
    "nemotron_h": Arch("nemotron_h", _NEMOTRON_H_NAMES, top=_BACKBONE_TOP,
                       layers="backbone.layers", undo=_undo_nemotron_h, needs=_SSM_KEYS,
                       configure=_nemotron_h_config),
}  # fmt: skip
