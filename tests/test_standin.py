"""The CPU stand-in pair: widening keeps logits, the draft's weights really change."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.llama import Model, ModelArgs

from specmlx.standins.cpu_demo import quantize_dequantize, widen


def tiny_model(seed: int = 0) -> Model:
    args = ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=97,
        rope_traditional=True,
    )
    model = Model(args)
    mx.random.seed(seed)
    # Random norm weights too, so the sqrt(1/m) rescaling is really exercised.
    params = [(k, 0.2 * mx.random.normal(v.shape)) for k, v in tree_flatten(model.parameters())]
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


def widened(model: Model, m: int) -> Model:
    weights, args = widen(dict(tree_flatten(model.parameters())), model.args, m)
    wide = Model(args)
    wide.load_weights(list(weights.items()))
    return wide


@pytest.mark.parametrize("m", [2, 3])
def test_widen_keeps_logits(m: int) -> None:
    model = tiny_model()
    wide = widened(model, m)
    assert wide.args.hidden_size == 64 * m and wide.args.num_key_value_heads == 2 * m
    tokens = mx.random.randint(0, 97, (2, 12))
    assert mx.max(mx.abs(wide(tokens) - model(tokens))).item() < 1e-4


@pytest.mark.parametrize("m", [2, 3])
def test_widen_keeps_logits_with_cache(m: int) -> None:
    model = tiny_model(1)
    wide = widened(model, m)
    c1, c2 = make_prompt_cache(model), make_prompt_cache(wide)
    tokens = mx.random.randint(0, 97, (1, 20))
    for chunk in (tokens[:, :7], tokens[:, 7:8], tokens[:, 8:11], tokens[:, 11:12], tokens[:, 12:]):
        assert mx.max(mx.abs(wide(chunk, cache=c2) - model(chunk, cache=c1))).item() < 1e-4


def test_quantize_dequantize_changes_weights_only_in_blocks() -> None:
    weights = dict(tree_flatten(tiny_model().parameters()))
    out = quantize_dequantize(weights, bits=4, group_size=64)
    assert out.keys() == weights.keys()
    for k, w in weights.items():
        assert out[k].shape == w.shape and out[k].dtype == mx.float32
        changed = not mx.array_equal(out[k], w).item()
        assert changed == (".layers." in k and k.endswith("_proj.weight")), k


@pytest.mark.slow
def test_real_pair_keeps_logits_and_draft_differs(tmp_path) -> None:
    try:
        from specmlx.errors import SpecmlxError
        from specmlx.models.loading import load_model
        from specmlx.models.registry import load_registry

        base = load_model(load_registry().resolve("smollm2-135m"))
    except (ImportError, SpecmlxError) as e:
        pytest.skip(f"SmolLM2-135M weights unavailable: {e}")
    from specmlx.standins.cpu_demo import PROMPTS, build_cpu_pair

    base.model.set_dtype(mx.float32)
    # m=2 keeps this test to about half the cost of the shipped m=3 pair; the math is the same.
    facts = build_cpu_pair(
        base.model, base.tokenizer, tmp_path, m=2, prompts=PROMPTS[:2], continuation=16
    )
    assert facts["max_abs_dlogit"] < 1e-3
    assert facts["target_follows_base"] > 0.9
    assert 0.5 < facts["draft_agreement"] < 1.0
    assert (tmp_path / "pair.json").is_file()
