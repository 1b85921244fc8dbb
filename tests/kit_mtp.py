"""The MTP kit: random MTP heads over tiny targets (specmlx/drafting/heads/mtp.py), greedy
generation and the greedy-identity check, and checkpoints laid out as Hugging Face ships
them, with their heads: the Qwen families' (``mtp.*``: Qwen3-Next, Qwen3.5, Qwen3.5 MoE)
and the ``model.layers.{N}`` ones (DeepSeek-V3, GLM-4.5; their tiny configs here). Used by
test_mtp, test_mtp_deepseek, test_mtp_dense, test_mtp_fronts and test_drafter_kinds.
(tests/mtp_toy.py is the other MTP helper: a head trained on a toy language.)"""

import json
import math

import mlx.core as mx
from families import family_config
from helpers import generate, save_tiny, tiny_tokenizer
from mlx.utils import tree_flatten, tree_map

from specmlx.core.stats import Stats
from specmlx.drafting.heads.mtp import MTPHead
from specmlx.models.loading import _load_dir

PROMPT = list(range(1, 20))


def random_head(target, family: str, seed: int = 3, scale: float = 0.3) -> MTPHead:
    head = MTPHead(target, family)
    mx.random.seed(seed)
    head.update(tree_map(lambda p: scale * mx.random.normal(p.shape), head.parameters()))
    mx.eval(head.parameters())
    return head


def tokens(target, draft, prompt=PROMPT, **kw):
    return [e.token for e in generate(target, draft, prompt, **kw)]


def check_greedy(target, head, k: int, n: int = 40) -> None:
    """Greedy speculation with the head at k, alone and with lookup first, is the target's
    plain decoding, and the head did draft (a random head's drafts are mostly rejected)."""
    plain = tokens(target, None, k=0, max_tokens=n)
    stats = Stats()
    assert tokens(target, head, k=k, max_tokens=n, stats=stats) == plain
    assert stats.drafted >= (n - 10) * k // 2
    assert tokens(target, head, k=k, max_tokens=n, lookup=True) == plain


# ---------------------------------------------------------------- the Qwen families' checkpoints

_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
          ".q_norm.weight", ".k_norm.weight")  # fmt: skip
# MTPHead's names -> the checkpoint's (after "mtp.")
QWEN_HF_NAMES = {"norm_e": "pre_fc_norm_embedding", "norm_h": "pre_fc_norm_hidden", "fc": "fc",
                 "layer": "layers.0", "norm": "norm"}  # fmt: skip


def _unstack(name: str, v: mx.array) -> dict[str, mx.array]:
    """mlx-lm's stacked experts (``...mlp.switch_mlp.{n}.weight``, (E, out, in)) as a
    checkpoint stores them, one tensor per expert."""
    if ".switch_mlp." not in name:
        return {name: v}
    return {name.replace(".switch_mlp.", f".experts.{e}."): v[e] for e in range(v.shape[0])}


def raw_checkpoint(path, seed=0, family="qwen3_5"):
    """A tiny Qwen3.5 (or Qwen3-Next) saved as Hugging Face ships it (mlx-lm's conversions
    undone: key prefixes, experts one tensor each, the conv1d layout, norms stored
    zero-centred) with an MTP head; returns the model and head as they should load."""
    tok = tiny_tokenizer()
    config = {"model_type": family, **family_config(family, 2)}
    text = config.get("text_config", config)
    text["vocab_size"] = len(tok)
    text["mtp_num_hidden_layers" if family == "qwen3_5" else "num_nextn_predict_layers"] = 1
    save_tiny(path, config, tok, seed)
    weights = mx.load(str(path / "model.safetensors"))
    raw = {}
    for k, v in weights.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # (C, K, 1) -> (C, 1, K), as torch stores it
        if k.endswith(_NORMS) and v.ndim == 1:
            v = v - 1.0
        raw.update(_unstack(k.replace("language_model.model.", "model.language_model."), v))
    model, _, _ = _load_dir(path)
    head = random_head(model, family, seed=seed + 5)
    for k, v in tree_flatten(head.parameters()):
        first, rest = k.split(".", 1)
        name = f"mtp.{QWEN_HF_NAMES[first]}.{rest}"
        shifted = rest == "weight" and first.startswith("norm") or k.endswith(_NORMS)
        raw.update(_unstack(name, v - 1.0 if shifted and v.ndim == 1 else v))
    for f in path.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(path / "model.safetensors"), raw)
    (path / "config.json").write_text(json.dumps(config))
    return model, head


# ---------------------------------------------------------------- model.layers.{N} checkpoints


def deepseek_v3_config(layers: int, dense: int = 1) -> dict:
    # MLA with a q LoRA, 4 routed experts in 2 groups and one shared expert
    return dict(model_type="deepseek_v3", vocab_size=128, hidden_size=32,
                intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=dense,
                max_position_embeddings=512, num_nextn_predict_layers=1)  # fmt: skip


def glm4_moe_config(layers: int) -> dict:
    return dict(model_type="glm4_moe", vocab_size=128, hidden_size=32, intermediate_size=64,
                max_position_embeddings=512, moe_intermediate_size=16, norm_topk_prob=True,
                num_attention_heads=4, n_group=1, head_dim=8, topk_group=1,
                n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
                num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=layers,
                num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False,
                attention_bias=True, partial_rotary_factor=0.5,
                num_nextn_predict_layers=1)  # fmt: skip


# MTPHead's names -> the checkpoint's (after "model.layers.{N}.")
NEXTN_HF_NAMES = {"norm_e": "enorm", "norm_h": "hnorm", "fc": "eh_proj",
                  "norm": "shared_head.norm", "layer": None}  # fmt: skip
_FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size
_FP8_SCALE = 2.0  # a power of two: the round trip through FP8 stays exact


def _fp8_exact(v: mx.array) -> mx.array:
    """``v`` moved to the nearest value an FP8 block with scale _FP8_SCALE holds exactly."""
    return mx.from_fp8(mx.to_fp8(v / _FP8_SCALE), dtype=mx.bfloat16).astype(v.dtype) * _FP8_SCALE


def _fp8(name: str, v: mx.array) -> dict[str, mx.array]:
    """A 2-D weight as DeepSeek's FP8 checkpoints store it: FP8 bytes and a scale per block."""
    blocks = tuple(math.ceil(n / _FP8_BLOCK) for n in v.shape)
    return {name: mx.to_fp8(v / _FP8_SCALE),
            name.replace(".weight", ".weight_scale_inv"): mx.full(blocks, _FP8_SCALE)}  # fmt: skip


def nextn_layout(head: MTPHead) -> dict[str, mx.array]:
    """The head's parameters named and laid out as the checkpoint has them, after the
    prefix: per-expert tensors, and DeepSeek's kv_b_proj whole (mlx-lm splits it for MLA)."""
    out = {}
    for k, v in tree_flatten(head.parameters()):
        first, rest = k.split(".", 1)
        name = rest if NEXTN_HF_NAMES[first] is None else f"{NEXTN_HF_NAMES[first]}.{rest}"
        if ".switch_mlp." in name:
            for e in range(v.shape[0]):
                out[name.replace(".switch_mlp.", f".experts.{e}.")] = v[e]
        elif name.endswith("embed_q.weight"):  # (heads, rank, nope) and (heads, v, rank)
            attn = head.layer.self_attn
            kv_b = mx.concatenate([v.swapaxes(-1, -2), attn.unembed_out.weight], axis=1)
            out[name.replace("embed_q", "kv_b_proj")] = kv_b.reshape(-1, kv_b.shape[-1])
        elif not name.endswith("unembed_out.weight"):
            out[name] = v
    return out


def raw_nextn_checkpoint(path, config: dict, fp8: bool, seed: int = 0):
    """A tiny model of ``config`` saved by mlx-lm, with an MTP layer under
    ``model.layers.{N}`` as Hugging Face ships it (``fp8``: its projections in FP8 blocks,
    as DeepSeek-V3's); returns the target and the head as they should load."""
    tok = tiny_tokenizer()
    config = {**config, "vocab_size": len(tok)}
    save_tiny(path, config, tok, seed)
    raw = dict(mx.load(str(path / "model.safetensors")))
    model, _, _ = _load_dir(path)
    head = random_head(model, config["model_type"], seed=seed + 5)
    if fp8:
        head.update(tree_map(_fp8_exact, head.parameters()))
    prefix = f"model.layers.{config['num_hidden_layers']}."
    for k, v in nextn_layout(head).items():
        if fp8 and k.endswith("_proj.weight"):
            raw.update({prefix + n: w for n, w in _fp8(k, v).items()})
        else:
            raw[prefix + k] = v
    # the head's copies of the target's embedding and LM head: not read
    raw[prefix + "embed_tokens.weight"] = raw["model.embed_tokens.weight"]
    raw[prefix + "shared_head.head.weight"] = raw["lm_head.weight"]
    for f in path.glob("*.safetensors"):
        f.unlink()
    mx.save_safetensors(str(path / "model.safetensors"), raw)
    (path / "config.json").write_text(json.dumps(config))
    return model, head
