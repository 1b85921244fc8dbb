"""DeepSeek-V3 and GLM-4.5 MTP heads (specmlx/drafting/mtp.py's ``model.layers.{N}`` families): tiny
random targets from mlx-lm's own deepseek_v3 and glm4_moe classes, greedy decoding with a
random head token-identical to plain decoding, the head's cache what an offline feed of the
right pairs builds, the embedding of the pair at position 0 zeroed, and loading from a
checkpoint laid out as Hugging Face ships it (per-expert tensors, DeepSeek's kv_b_proj and
FP8 blocks)."""

import importlib
import json
import math

import mlx.core as mx
import pytest
from helpers import save_tiny, tiny_tokenizer
from mlx.utils import tree_flatten, tree_map
from test_mtp import check_greedy, random_head, tokens

from specmlx.core.hidden import HiddenTap
from specmlx.decoding.engine import KVState
from specmlx.drafting.mtp import MTPHead
from specmlx.errors import IncompatiblePair
from specmlx.models.loading import _load_dir, load_pair

PROMPT = list(range(1, 20))


def _deepseek_v3(layers: int, dense: int = 1) -> dict:
    # MLA with a q LoRA, 4 routed experts in 2 groups and one shared expert
    return dict(model_type="deepseek_v3", vocab_size=128, hidden_size=32,
                intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                n_routed_experts=4, routed_scaling_factor=2.5, kv_lora_rank=16,
                q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=dense,
                max_position_embeddings=512, num_nextn_predict_layers=1)  # fmt: skip


def _glm4_moe(layers: int) -> dict:
    return dict(model_type="glm4_moe", vocab_size=128, hidden_size=32, intermediate_size=64,
                max_position_embeddings=512, moe_intermediate_size=16, norm_topk_prob=True,
                num_attention_heads=4, n_group=1, head_dim=8, topk_group=1,
                n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
                num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=layers,
                num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False,
                attention_bias=True, partial_rotary_factor=0.5,
                num_nextn_predict_layers=1)  # fmt: skip


CONFIGS = {"deepseek_v3": _deepseek_v3, "glm4_moe": _glm4_moe}


def build(config: dict, seed: int = 0):
    """A random mlx-lm model of ``config``; the weights mlx-lm starts at zero (the routers)
    get random values, so routing depends on the input."""
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))

    def fill(p):
        return p if mx.any(p).item() else 0.3 * mx.random.normal(p.shape)

    model.update(tree_map(fill, model.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def family_pair(request):
    target = build(CONFIGS[request.param](2))
    return request.param, target, random_head(target, request.param)


def test_the_head_is_the_familys_own_moe_layer(family_pair):
    family, _, head = family_pair
    assert type(head.layer).__module__ == f"mlx_lm.models.{family}"
    assert hasattr(head.layer.mlp, "switch_mlp") and hasattr(head.layer.mlp, "shared_experts")


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_mtp_is_token_identical(family_pair, k):
    _, target, head = family_pair
    check_greedy(target, head, k, n=30)


def test_the_head_is_fed_the_right_hidden_state_and_token(family_pair):
    """After a generation, the head's cache holds what feeding it the pairs (h_j, t_{j+1})
    offline, h from one fresh target pass, builds (MLA caches its latent as the keys)."""
    _, target, head = family_pair
    kv = KVState()
    ctx = PROMPT + tokens(target, head, k=3, max_tokens=16, kv=kv)
    fed = kv.draft_len
    assert fed >= len(PROMPT)
    with HiddenTap(target) as tap:
        target(mx.array(ctx)[None])
    cache = head.make_cache()
    head(tap.final()[:, :fed], mx.array(ctx[1 : fed + 1])[None], cache)
    want = cache[0].state[0][..., :fed, :]
    assert mx.allclose(kv.draft[0].state[0][..., :fed, :], want, atol=1e-4).item()


def test_the_embedding_at_position_0_is_zeroed(family_pair):
    """The first pair's token changes nothing (vLLM zeroes its embedding); at a later
    position the same change moves the output (the control)."""
    _, target, head = family_pair
    hidden = mx.random.normal((1, 3, 32), key=mx.random.key(1))
    a, b = mx.array([[5, 6, 7]]), mx.array([[9, 6, 7]])
    ga, _ = head(hidden, a, head.make_cache())
    gb, _ = head(hidden, b, head.make_cache())
    assert mx.array_equal(ga, gb).item()
    later = []
    for t in (a, b):
        cache = head.make_cache()
        head(hidden[:, :1], mx.array([[4]]), cache)  # position 0 taken: t is at 1..3
        later.append(head(hidden, t, cache)[0])
    assert not mx.allclose(later[0][:, 0], later[1][:, 0], atol=1e-4).item()


# ---------------------------------------------------------------- loading

# this module's names -> the checkpoint's (after "model.layers.{N}.")
_HF_NAMES = {"norm_e": "enorm", "norm_h": "hnorm", "fc": "eh_proj", "norm": "shared_head.norm",
             "layer": None}  # fmt: skip
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


def _hf_layout(head: MTPHead) -> dict[str, mx.array]:
    """The head's parameters named and laid out as the checkpoint has them, after the
    prefix: per-expert tensors, and DeepSeek's kv_b_proj whole (mlx-lm splits it for MLA)."""
    out = {}
    for k, v in tree_flatten(head.parameters()):
        first, rest = k.split(".", 1)
        name = rest if _HF_NAMES[first] is None else f"{_HF_NAMES[first]}.{rest}"
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


def _raw_checkpoint(path, config: dict, fp8: bool, seed: int = 0):
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
    for k, v in _hf_layout(head).items():
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


# 61 layers (dense but the last: still tiny), DeepSeek-V3's own MTP index, the one mlx-lm's
# deepseek_v3 sanitize drops itself; other depths are left out by specmlx (test_mtp_dense.py)
@pytest.mark.parametrize(
    "config, fp8",
    [(_deepseek_v3(61, dense=60), True), (_glm4_moe(2), False)],
    ids=["deepseek_v3", "glm4_moe"],
)
def test_a_raw_checkpoints_head_loads_exactly(tmp_path, specmlx_home, config, fp8):
    model, head = _raw_checkpoint(tmp_path / "m", config, fp8)
    target, draft, shared = load_pair(str(tmp_path / "m"), "mtp")
    x = mx.array([[3, 1, 4, 1, 5]])
    assert mx.allclose(target.model(x), model(x), atol=1e-5).item()  # mlx-lm's own loading
    loaded = dict(tree_flatten(draft.model.parameters()))
    want = dict(tree_flatten(head.parameters()))
    assert loaded.keys() == want.keys()
    for k, v in want.items():
        assert mx.allclose(loaded[k], v, atol=1e-6).item(), k
    assert draft.identity == target.identity + "|mtp" and shared == target.vocab_size


def test_a_checkpoint_without_its_mtp_layer_is_refused(tmp_path, specmlx_home):
    """mlx-community's conversions drop model.layers.{N}: --draft mtp says so."""
    tok = tiny_tokenizer()
    save_tiny(tmp_path / "g", {**_glm4_moe(2), "vocab_size": len(tok)}, tok, 0)
    with pytest.raises(IncompatiblePair, match=r"\(glm4_moe\) has no MTP head"):
        load_pair(str(tmp_path / "g"), "mtp")
