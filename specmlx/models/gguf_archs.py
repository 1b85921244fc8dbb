"""The llama.cpp architectures specmlx loads, as `Arch` entries: how each one's tensor
names map onto an mlx-lm model class. Here the entry type, the names every family shares
(a llama block's, the top tensors', Qwen3's q/k norms) and the llama-like families: llama,
qwen2, qwen3, qwen3moe, starcoder2, gemma3. The hybrid families are in gguf_hybrids.py;
gguf.py reads a file and builds the model from its entry."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}  # fmt: skip
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@dataclass(frozen=True)
class Arch:
    """How one llama.cpp architecture maps onto an mlx-lm model class."""

    model_type: str  # mlx-lm's module
    names: dict[str, str]  # llama.cpp block tensor -> mlx-lm name within the layer
    rope_traditional: bool = False  # llama.cpp permutes q/k for llama only
    norm_shift: float = 0.0  # llama.cpp stored norm weights + this (Gemma's 1 + w)
    extra: dict = field(default_factory=dict)
    top: dict[str, str] = field(default_factory=lambda: TOP_NAMES)  # non-block tensors
    layers: str = "model.layers"  # where mlx-lm keeps the blocks
    # the converter's other changes undone (weights in mlx-lm names, the config), and the
    # tensors that undoing rearranges: those are dequantized first
    undo: Callable[[dict, dict], dict] | None = None
    rearranged: tuple[str, ...] = ()
    # metadata keys the family needs besides the common ones, and its own config fields
    # from them: configure(get, tensors, config so far, path) -> fields
    needs: tuple[str, ...] = ()
    configure: Callable[[Callable, dict, dict, Path], dict] | None = None


_GEMMA3_NAMES = {
    **{k: v for k, v in BLOCK_NAMES.items() if k != "ffn_norm"}, **QK_NORMS,
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}  # fmt: skip
_MOE_NAMES = {
    **{k: v for k, v in BLOCK_NAMES.items() if not k.startswith("ffn_") or k == "ffn_norm"},
    **QK_NORMS, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj",
}  # fmt: skip
_STARCODER2_NAMES = {
    **{k: v for k, v in BLOCK_NAMES.items() if not k.startswith("ffn_") or k == "ffn_norm"},
    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}  # fmt: skip


def per_layer(value: int | list[int]) -> list[int]:
    """A key llama.cpp writes as one number or one per layer (head_count_kv of a hybrid)."""
    return list(value) if isinstance(value, (list, tuple)) else [value]


LLAMA_ARCHS = {
    "llama": Arch("llama", BLOCK_NAMES, rope_traditional=True),
    # Qwen3-MoE: the experts stacked (experts, out, in), as mlx-lm's SwitchGLU keeps them;
    # llama.cpp renormalizes the top-k weights for this architecture
    "qwen3moe": Arch("qwen3_moe", _MOE_NAMES,
                     extra={"norm_topk_prob": True, "decoder_sparse_step": 1,
                            "mlp_only_layers": []}),
    "starcoder2": Arch("starcoder2", _STARCODER2_NAMES),
    "qwen2": Arch("qwen2", BLOCK_NAMES),
    "qwen3": Arch("qwen3", BLOCK_NAMES | QK_NORMS),
    # Gemma 3: RMSNorm is x * (1 + w) in HF and mlx-lm, and llama.cpp's converter stores
    # w + 1 to use a plain RMSNorm (convert_hf_to_gguf.py, Gemma3Model.norm_shift); it hard-codes
    # a sliding window on 5 of every 6 layers with a local RoPE base of 10000
    "gemma3": Arch("gemma3_text", _GEMMA3_NAMES, norm_shift=1.0,
                   extra={"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0}),
}  # fmt: skip
