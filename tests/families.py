"""Tiny random models of mlx-lm's own families, built from their ModelArgs: stand-ins for
architectures that cannot be downloaded here. For mechanics only (rollback, exactness),
never for claims about speed or acceptance.

Each family has a config function of (layers) giving a dict for ModelArgs.from_dict; the
windows are small (8) so a short prompt already runs past them.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

VOCAB = 128
WINDOW = 8


def _llama(n):
    return dict(hidden_size=32, num_hidden_layers=n, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                vocab_size=VOCAB, tie_word_embeddings=False)  # fmt: skip


def _llama_swa(n):
    # mlx-lm's llama with a sliding window on every other layer (Mistral/Ministral style)
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return dict(_llama(n), sliding_window=WINDOW, layer_types=types)


def _qwen3(n):
    return dict(_llama(n), head_dim=8, rope_theta=10000.0, max_position_embeddings=512)


def _qwen3_moe(n):
    return dict(_qwen3(n), num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True)  # fmt: skip


def _gemma3_text(n):
    return dict(hidden_size=32, num_hidden_layers=n, intermediate_size=64,
                num_attention_heads=4, head_dim=8, vocab_size=VOCAB, num_key_value_heads=2,
                sliding_window=WINDOW, sliding_window_pattern=3)  # fmt: skip


def _gpt_oss(n):
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return dict(num_hidden_layers=n, num_local_experts=4, num_experts_per_tok=2,
                vocab_size=VOCAB, hidden_size=32, intermediate_size=32, head_dim=8,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
                layer_types=types)  # fmt: skip


def _cohere2(n):
    return dict(hidden_size=32, head_dim=8, num_hidden_layers=n, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                sliding_window=WINDOW, sliding_window_pattern=2)  # fmt: skip


def _olmo3(n):
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return dict(_llama(n), max_position_embeddings=512, sliding_window=WINDOW,
                rope_theta=10000.0, layer_types=types, head_dim=8)  # fmt: skip


def _ministral3(n):
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    rope = {
        "rope_theta": 10000.0,
        "rope_type": "default",
        "llama_4_scaling_beta": 0.1,
        "original_max_position_embeddings": 512,
    }
    return dict(_llama(n), head_dim=8, max_position_embeddings=512, sliding_window=WINDOW,
                layer_types=types, rope_parameters=rope)  # fmt: skip


def _exaone4(n):
    return dict(_llama(n), max_position_embeddings=512, rope_theta=10000.0, head_dim=8,
                rope_scaling=None, sliding_window=WINDOW, sliding_window_pattern="LG")  # fmt: skip


def _gemma4_text(n):
    # the last layer reads the KV of an earlier one (Gemma 4's KV sharing)
    return dict(hidden_size=32, num_hidden_layers=n, intermediate_size=64,
                num_attention_heads=4, head_dim=8, global_head_dim=16, vocab_size=VOCAB,
                vocab_size_per_layer_input=VOCAB, num_key_value_heads=1,
                num_kv_shared_layers=1, hidden_size_per_layer_input=8, sliding_window=WINDOW,
                sliding_window_pattern=2, max_position_embeddings=512,
                use_double_wide_mlp=False)  # fmt: skip


def _qwen3_next(n):
    return dict(hidden_size=32, num_hidden_layers=n, intermediate_size=64,
                num_attention_heads=4, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                shared_expert_intermediate_size=32, mlp_only_layers=[],
                moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=VOCAB,
                num_key_value_heads=2, rope_theta=10000.0, partial_rotary_factor=0.5,
                max_position_embeddings=512, head_dim=8, full_attention_interval=2)  # fmt: skip


def _qwen3_5(n):
    text = dict(model_type="qwen3_5_text", hidden_size=32, intermediate_size=64,
                num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=VOCAB, linear_num_value_heads=4, linear_num_key_heads=2,
                linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                head_dim=8, full_attention_interval=2,
                rope_parameters={"type": "default", "mrope_section": [1, 1, 0],
                                 "rope_theta": 10000.0, "partial_rotary_factor": 0.5})  # fmt: skip
    return dict(text_config=text)


def _mamba2(n):
    return dict(num_heads=4, head_dim=8, vocab_size=VOCAB, hidden_size=16,
                intermediate_size=32, state_size=8, num_hidden_layers=n,
                layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=1, use_bias=False,
                use_conv_bias=True, tie_word_embeddings=False, time_step_limit=(0.0, 100.0),
                time_step_rank=4)  # fmt: skip


def _nemotron_h(n):
    pattern = "".join("M*-"[i % 3] for i in range(n))  # mamba, attention, MLP in turn
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2,
                attention_bias=False, mamba_num_heads=4, mamba_head_dim=8,
                mamba_proj_bias=False, ssm_state_size=8, conv_kernel=4, n_groups=1,
                mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                hybrid_override_pattern=list(pattern), num_hidden_layers=n, head_dim=8,
                time_step_limit=(0.0, 100.0))  # fmt: skip


def _falcon_h1(n):
    return dict(hidden_size=32, head_dim=8, intermediate_size=64, mamba_d_conv=4,
                mamba_d_head=8, mamba_d_ssm=32, mamba_d_state=8, mamba_n_heads=4,
                mamba_n_groups=1, num_attention_heads=4, num_hidden_layers=n,
                num_key_value_heads=2, vocab_size=VOCAB, mamba_chunk_size=8)  # fmt: skip


def _granitemoehybrid(n):
    types = ["mamba" if i % 2 == 0 else "attention" for i in range(n)]
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                num_hidden_layers=n, max_position_embeddings=512, num_attention_heads=4,
                num_key_value_heads=2, attention_bias=False, embedding_multiplier=1.0,
                attention_multiplier=0.35, logits_scaling=1.0, residual_multiplier=1.0,
                layer_types=types, rms_norm_eps=1e-5, mamba_n_heads=4, mamba_d_head=8,
                mamba_proj_bias=False, mamba_d_state=8, mamba_d_conv=4, mamba_n_groups=1,
                mamba_conv_bias=True, shared_intermediate_size=64, num_local_experts=0,
                num_experts_per_tok=0, position_embedding_type="rope",
                rope_theta=10000.0)  # fmt: skip


def _lfm2(n):
    return dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=32,
                block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                block_auto_adjust_ff_dim=False, block_ff_dim=64,
                full_attn_idxs=[i for i in range(n) if i % 2 == 1])  # fmt: skip


def _jamba(n):
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=n,
                num_attention_heads=4, num_key_value_heads=2, attn_layer_offset=1,
                attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2,
                mamba_d_conv=4, mamba_d_state=8, mamba_expand=2, num_experts=4,
                num_experts_per_tok=2, rms_norm_eps=1e-6, max_position_embeddings=512,
                vocab_size=VOCAB)  # fmt: skip


def _rwkv7(n):
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, norm_eps=1e-5,
                head_dim=8, num_hidden_layers=n, a_low_rank_dim=8, v_low_rank_dim=8,
                gate_low_rank_dim=8, decay_low_rank_dim=8)  # fmt: skip


# module name -> (config, cache kind the family brings: "full", "window" or "recurrent")
FAMILIES = {
    "llama": (_llama, "full"),
    "llama_swa": (_llama_swa, "window"),
    "qwen3": (_qwen3, "full"),
    "qwen3_moe": (_qwen3_moe, "full"),
    "gemma3_text": (_gemma3_text, "window"),
    "gpt_oss": (_gpt_oss, "window"),
    "cohere2": (_cohere2, "window"),
    "olmo3": (_olmo3, "window"),
    "ministral3": (_ministral3, "window"),
    "exaone4": (_exaone4, "window"),
    "gemma4_text": (_gemma4_text, "window"),
    "qwen3_next": (_qwen3_next, "recurrent"),
    "qwen3_5": (_qwen3_5, "recurrent"),
    "mamba2": (_mamba2, "recurrent"),
    "nemotron_h": (_nemotron_h, "recurrent"),
    "falcon_h1": (_falcon_h1, "recurrent"),
    "granitemoehybrid": (_granitemoehybrid, "recurrent"),
    "lfm2": (_lfm2, "recurrent"),
    "jamba": (_jamba, "recurrent"),
    "rwkv7": (_rwkv7, "recurrent"),
}


def family_config(family: str, layers: int, vocab: int = VOCAB) -> dict:
    """The config dict ModelArgs.from_dict takes for a tiny ``family`` model."""
    config = {"model_type": family.removesuffix("_swa"), **FAMILIES[family][0](layers)}
    inner = config.get("text_config", config)
    inner["vocab_size"] = vocab
    return config


def build(family: str, layers: int, seed: int, scale: float = 1.0, vocab: int = VOCAB):
    """A tiny random model of ``family`` (a key of FAMILIES) with ``layers`` layers and
    ``vocab`` ids, in float32. ``scale`` multiplies every weight, to make the logits more or
    less peaked."""
    module = importlib.import_module(f"mlx_lm.models.{family.removesuffix('_swa')}")
    args = module.ModelArgs.from_dict(family_config(family, layers, vocab))
    mx.random.seed(seed)
    model = module.Model(args)
    key = iter(mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters()))))

    def fill(p):
        # weights a family initializes to zero (rwkv7's mixing terms, some biases) would
        # leave the tiny model blind to its context: give them small random values
        if not mx.any(p).item():
            return 0.1 * mx.random.normal(p.shape, key=next(key))
        return (p * scale).astype(mx.float32)

    model.update(tree_map(fill, model.parameters()))
    mx.eval(model.parameters())
    assert tree_flatten(model.parameters())
    return model


def noisy_copy(
    family: str, layers: int, seed: int, noise: float, scale: float = 1.0, vocab: int = VOCAB
):
    """``build(family, layers, seed, scale)`` with every weight moved by ``noise`` times its
    tensor's spread: a draft that agrees with that target often but not always, so rounds
    keep some drafts and reject others (every rollback path runs)."""
    model = build(family, layers, seed, scale, vocab)
    key = mx.random.key(seed + 1000)
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(key, len(flat))
    moved = [
        (name, p + noise * (p.std() + 1e-6) * mx.random.normal(p.shape, key=k))
        for (name, p), k in zip(flat, keys, strict=True)
    ]
    model.load_weights(moved)
    mx.eval(model.parameters())
    return model
