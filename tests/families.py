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
    config = {"model_type": family.removesuffix("_swa"), **(FAMILIES | OUTSIDE)[family][0](layers)}
    inner = config.get("text_config", config)
    inner["vocab_size"] = vocab
    return config


def build(family: str, layers: int, seed: int, scale: float = 1.0, vocab: int = VOCAB):
    """A tiny random model of ``family`` (a key of FAMILIES or OUTSIDE) with ``layers`` layers and
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


# --- families outside the matrix above (tests/test_family_sweep.py): mlx-lm 0.32 modules
# whose caches are not plain KVCache, each tiny and built the same way


def _types(n, other="sliding_attention", every=2):
    """A layer_types list: every ``every``-th layer (1-based) full attention, the rest ``other``."""
    return ["full_attention" if (i + 1) % every == 0 else other for i in range(n)]


def _afmoe(n):
    return dict(_qwen3(n), layer_types=_types(n), moe_intermediate_size=32, num_experts=4,
                num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1,
                sliding_window=WINDOW)  # fmt: skip


def _baichuan_m1(n):
    return dict(_llama(n), rope_theta=10000.0, sliding_window=WINDOW,
                sliding_window_layers=[i for i in range(n) if i % 2 == 0], conv_window=2,
                num_swa_attention_heads=4, num_swa_key_value_heads=2)  # fmt: skip


def _exaone_moe(n):
    return dict(_qwen3(n), moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                num_shared_experts=1, sliding_window=WINDOW, layer_types=_types(n),
                is_moe_layer=[i > 0 for i in range(n)])  # fmt: skip


def _gear(n):
    types = ["sliding_attention", "conv_mixer", "full_attention", "conv_mixer"] * (n // 4 + 1)
    return dict(_qwen3(n), sliding_window=WINDOW, layer_types=types[:n],
                conv_L_cache=3)  # fmt: skip


def _gemma3n(n):
    text = dict(model_type="gemma3n_text", hidden_size=32, num_hidden_layers=n,
                intermediate_size=[64] * n, num_attention_heads=4, head_dim=8,
                rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=2,
                num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
                sliding_window=WINDOW, max_position_embeddings=512,
                rope_local_base_freq=10000.0, rope_theta=1000000.0,
                final_logit_softcapping=30.0, layer_types=_types(n),
                activation_sparsity_pattern=[0.0] * n, hidden_size_per_layer_input=8,
                altup_num_inputs=2, altup_coef_clip=120.0, altup_correct_scale=True,
                altup_active_idx=0, laurel_rank=4)  # fmt: skip
    return dict(text_config=text)


def _iquestloopcoder(n):
    return dict(_qwen3(n), loop_num=2, loop_window_size=WINDOW)


def _laguna(n):
    return dict(_qwen3(n), sliding_window=WINDOW, layer_types=_types(n),
                mlp_layer_types=["dense"] + ["sparse"] * (n - 1), num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=32)  # fmt: skip


def _mellum(n):
    return dict(_qwen3(n), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                norm_topk_prob=True, sliding_window=WINDOW, layer_types=_types(n),
                rope_parameters={t: {"rope_theta": 10000.0, "rope_type": "default"}
                                 for t in ("sliding_attention", "full_attention")})  # fmt: skip


def _mimo_v2_flash(n):
    return dict(num_experts_per_tok=2, hybrid_layer_pattern=[1 if i % 2 == 0 else 0
                for i in range(n)], moe_layer_freq=[0] + [1] * (n - 1),
                add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
                sliding_window_size=WINDOW, vocab_size=VOCAB, hidden_size=32,
                intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=n,
                num_attention_heads=4, num_key_value_heads=2, n_shared_experts=None,
                n_routed_experts=4, routed_scaling_factor=1.0, topk_method="noaux_tc",
                scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
                max_position_embeddings=512, layernorm_epsilon=1e-6, rope_theta=10000.0,
                swa_rope_theta=10000.0, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                head_dim=8, v_head_dim=8, swa_head_dim=8, swa_v_head_dim=8,
                partial_rotary_factor=0.5)  # fmt: skip


def _muse_glimmer(n):
    return dict(hidden_size=32, num_hidden_layers=n, intermediate_size=64,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                sliding_window=WINDOW, layer_types=_types(n))  # fmt: skip


def _muse_spark(n):
    # the text model alone: vision_config is optional (None builds no vision tower)
    types = _types(n)
    text = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_hidden_layers=n, vocab_size=VOCAB, rms_norm_eps=1e-5, post_norm_eps=1e-8,
                rope_parameters={"rope_theta": 10000.0}, layer_types=types,
                layer_rope_theta=[0 if t == "full_attention" else 10000.0 for t in types],
                sliding_window=WINDOW, final_logit_softcapping=30.0, output_multiplier=1.0,
                num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=32,
                moe_intermediate_size=32)  # fmt: skip
    return dict(text_config=text)


def _plamo2(n):
    return dict(hidden_size=32, num_hidden_layers=n, num_attention_heads=4,
                num_key_value_heads=2, hidden_size_per_head=8, max_position_embeddings=512,
                attention_window_size=WINDOW, mamba_d_state=8, mamba_d_conv=4,
                mamba_num_heads=4, mamba_step=2, mamba_chunk_size=8, intermediate_size=64,
                vocab_size=VOCAB)  # fmt: skip


def _plamo3(n):
    return dict(hidden_size=32, num_hidden_layers=n, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                window_size=WINDOW, sliding_window_pattern=2, intermediate_size=64,
                vocab_size=VOCAB)  # fmt: skip


def _recurrent_gemma(n):
    return dict(attention_bias=False, conv1d_width=4, hidden_size=32, intermediate_size=64,
                logits_soft_cap=30.0, num_attention_heads=4, num_hidden_layers=n,
                num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                attention_window_size=WINDOW, vocab_size=VOCAB,
                block_types=["recurrent", "attention"])  # fmt: skip


def _spark2_5(n):
    rope = {t: {"rope_theta": 10000.0, "rope_type": "default"}
            for t in ("sliding_attention", "full_attention")}  # fmt: skip
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=n,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                sliding_window=WINDOW, rope_parameters=rope, layer_types=_types(n))  # fmt: skip


def _step3p5(n):
    return dict(hidden_size=32, num_hidden_layers=n, vocab_size=VOCAB, num_attention_heads=4,
                num_attention_groups=2, head_dim=8, intermediate_size=64,
                sliding_window=WINDOW, layer_types=_types(n), moe_num_experts=4, moe_top_k=2,
                moe_intermediate_size=32, share_expert_dim=32,
                moe_layers_enum=",".join(str(i) for i in range(1, n)))  # fmt: skip


def _mla(n):
    # the multi-head latent attention fields the DeepSeek-style families share
    return dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
                v_head_dim=8)  # fmt: skip


def _bailing_hybrid(n):
    return dict(_mla(n), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4,
                num_experts=4, num_experts_per_tok=2, num_shared_experts=1, n_group=1,
                topk_group=1, first_k_dense_replace=1, layer_group_size=2, group_norm_size=1,
                vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=512, routed_scaling_factor=1.0, head_dim=8)  # fmt: skip


def _bailing_moe_linear(n):
    return dict(hidden_size=32, intermediate_size=64, max_position_embeddings=512,
                moe_intermediate_size=32, num_experts=4, num_shared_experts=1,
                norm_topk_prob=True, num_attention_heads=4, num_experts_per_tok=2,
                num_hidden_layers=n, num_key_value_heads=2, rms_norm_eps=1e-6,
                rope_theta=10000.0, vocab_size=VOCAB, first_k_dense_replace=1,
                layer_group_size=2, group_norm_size=1, head_dim=8)  # fmt: skip


def _bailing_moe_v3(n):
    return dict(_mla(n), vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                num_hidden_layers=n, num_attention_heads=4, num_experts=4,
                num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
                n_group=1, topk_group=1, layer_group_size=2, head_dim=8,
                short_conv_kernel_size=4, max_position_embeddings=512)  # fmt: skip


def _kimi_linear(n):
    linear = {"kda_layers": [i + 1 for i in range(n) if i % 2 == 0], "num_heads": 4,
              "head_dim": 8, "short_conv_kernel_size": 4}  # fmt: skip
    return dict(_mla(n), vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n,
                num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-6, linear_attn_config=linear,
                model_max_length=512, num_experts=4, moe_intermediate_size=32,
                num_experts_per_token=2, first_k_dense_replace=1)  # fmt: skip


def _kimi_k3(n):
    text = _kimi_linear(n)
    text["linear_attn_config"] = dict(text["linear_attn_config"], num_heads=4)
    return dict(text_config=text)


def _lfm2_moe(n):
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                moe_intermediate_size=32, num_hidden_layers=n, num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=True, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, use_expert_bias=True,
                num_dense_layers=1, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                full_attn_idxs=[i for i in range(n) if i % 2 == 1])  # fmt: skip


def _longcat(n):
    return dict(_mla(n), hidden_size=32, ffn_hidden_size=64, moe_topk=2,
                expert_ffn_hidden_size=32, n_routed_experts=4, zero_expert_num=2,
                num_layers=n, vocab_size=VOCAB, max_position_embeddings=512,
                num_attention_heads=4, q_lora_rank=16, routed_scaling_factor=1.0,
                rms_norm_eps=1e-6, rope_theta=10000.0, mla_scale_q_lora=True,
                mla_scale_kv_lora=True, attention_method="MLA", zero_expert_type="identity",
                attention_bias=False)  # fmt: skip


def _longcat_flash_ngram(n):
    return dict(_longcat(n), ngram_vocab_size_ratio=4, emb_neighbor_num=3, emb_split_num=2)


def _mamba(n):
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, state_size=8,
                num_hidden_layers=n, conv_kernel=4, use_bias=False, use_conv_bias=True,
                time_step_rank=4)  # fmt: skip


def _olmo_hybrid(n):
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=n,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                vocab_size=VOCAB, max_position_embeddings=512, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
                tie_word_embeddings=False, attention_bias=False, head_dim=8,
                layer_types=_types(n, "linear_attention"))  # fmt: skip


def _llama4(n):
    text = dict(attention_bias=False, attention_chunk_size=WINDOW, head_dim=8, hidden_size=32,
                interleave_moe_layer_step=2, intermediate_size=32, intermediate_size_mlp=64,
                max_position_embeddings=512, model_type="llama4_text", num_attention_heads=4,
                num_experts_per_tok=1, num_hidden_layers=n, num_key_value_heads=2,
                num_local_experts=4, rms_norm_eps=1e-5, rope_scaling=None,
                rope_theta=10000.0, use_qk_norm=True, vocab_size=VOCAB)  # fmt: skip
    return dict(text_config=text)


def _deepseek_v32(n):
    return dict(_mla(n), q_lora_rank=16, vocab_size=VOCAB, hidden_size=32, index_head_dim=8,
                index_n_heads=2, index_topk=WINDOW, intermediate_size=64, moe_intermediate_size=32,
                num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4,
                n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
                first_k_dense_replace=1, max_position_embeddings=512)  # fmt: skip


def _minimax_m3_vl(n):
    # the text model's fields (the vision tower is not built by mlx-lm's Model)
    text = dict(model_type="minimax_m3", hidden_size=32, intermediate_size=32,
                dense_intermediate_size=64, shared_intermediate_size=32,
                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=n,
                num_local_experts=4, num_experts_per_tok=2, head_dim=8, vocab_size=VOCAB,
                moe_layer_freq=[0] + [1] * (n - 1), sparse_attention_freq=[1, 0] * n,
                index_n_heads=2, index_head_dim=8, index_block_size=4, index_topk_blocks=2,
                index_local_blocks=1)  # fmt: skip
    text["sparse_attention_freq"] = text["sparse_attention_freq"][:n]
    return dict(text_config=text)


def _deepseek_v41(n):
    return dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=n, num_attention_heads=4,
                head_dim=16, q_lora_rank=16, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
                moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                sliding_window=WINDOW, compress_ratios=[0] * n, index_n_heads=2,
                index_head_dim=8, index_topk=8, hc_mult=2, hc_sinkhorn_iters=2)  # fmt: skip


# module name -> (config, the cache kind it brings), as FAMILIES
OUTSIDE = {
    "afmoe": (_afmoe, "window"),
    "baichuan_m1": (_baichuan_m1, "recurrent"),
    "exaone_moe": (_exaone_moe, "window"),
    "gear": (_gear, "recurrent"),
    "gemma3n": (_gemma3n, "window"),
    "iquestloopcoder": (_iquestloopcoder, "window"),
    "laguna": (_laguna, "window"),
    "mellum": (_mellum, "window"),
    "mimo_v2_flash": (_mimo_v2_flash, "window"),
    "muse_glimmer": (_muse_glimmer, "window"),
    "muse_spark": (_muse_spark, "window"),
    "plamo2": (_plamo2, "recurrent"),
    "plamo3": (_plamo3, "window"),
    "recurrent_gemma": (_recurrent_gemma, "recurrent"),
    "spark2_5": (_spark2_5, "window"),
    "step3p5": (_step3p5, "window"),
    "bailing_hybrid": (_bailing_hybrid, "recurrent"),
    "bailing_moe_linear": (_bailing_moe_linear, "recurrent"),
    "bailing_moe_v3": (_bailing_moe_v3, "recurrent"),
    "kimi_k3": (_kimi_k3, "recurrent"),
    "kimi_linear": (_kimi_linear, "recurrent"),
    "lfm2_moe": (_lfm2_moe, "recurrent"),
    "longcat_flash_ngram": (_longcat_flash_ngram, "recurrent"),
    "mamba": (_mamba, "recurrent"),
    "olmo_hybrid": (_olmo_hybrid, "recurrent"),
    "llama4": (_llama4, "window"),  # chunked attention (ChunkedKVCache)
    "deepseek_v32": (_deepseek_v32, "full"),
    "longcat_flash": (_longcat, "full"),
    "minimax_m3_vl": (_minimax_m3_vl, "full"),
    "deepseek_v41": (_deepseek_v41, "window"),  # its own LayerCache
}
