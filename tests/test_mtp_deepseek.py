"""DeepSeek-V3 and GLM-4.5 MTP heads (specmlx/drafting/heads/mtp.py's ``model.layers.{N}`` families): tiny
random targets from mlx-lm's own deepseek_v3 and glm4_moe classes, greedy decoding with a
random head token-identical to plain decoding, the head's cache what an offline feed of the
right pairs builds, the embedding of the pair at position 0 zeroed, and loading from a
checkpoint laid out as Hugging Face ships it (per-expert tensors, DeepSeek's kv_b_proj and
FP8 blocks)."""

import importlib

import mlx.core as mx
import pytest
from helpers import save_tiny, tiny_tokenizer
from kit_mtp import (
    check_greedy,
    deepseek_v3_config,
    glm4_moe_config,
    random_head,
    raw_nextn_checkpoint,
    tokens,
)
from mlx.utils import tree_flatten, tree_map

from specmlx.core.batch_caches import rows_of
from specmlx.core.hidden import HiddenTap
from specmlx.decoding.engine import KVState
from specmlx.errors import IncompatiblePair
from specmlx.models.loading import load_pair

PROMPT = list(range(1, 20))


CONFIGS = {"deepseek_v3": deepseek_v3_config, "glm4_moe": glm4_moe_config}


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
    fed = kv.draft_held
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


def test_a_batchs_rows_zero_position_0_each_as_alone(family_pair):
    """In a batch (core.batch_caches: each row at its own length) only a row whose head cache is
    empty zeroes its first pair's embedding: each row's output is its solo one (this raised
    on a batch's per-row offsets before, and a head in a server's batch with it)."""
    _, target, head = family_pair
    hidden = mx.random.normal((1, 3, 32), key=mx.random.key(2))
    tokens = mx.array([[5, 6, 7]])

    def after(n: int) -> list:  # a head cache holding n pairs
        cache = head.make_cache()
        if n:
            head(hidden[:, :n], mx.array([[4] * n]), cache)
        return cache

    solo = [head(hidden, tokens, after(n))[0] for n in (0, 1, 0)]
    rows = None
    for n in (0, 1, 0):
        rows = rows_of(rows, after(n))
    batch = head(mx.concatenate([hidden] * 3), mx.concatenate([tokens] * 3), rows)[0]
    for i, want in enumerate(solo):
        assert mx.allclose(batch[i], want[0], atol=1e-4).item(), i
    assert not mx.allclose(solo[0], solo[1], atol=1e-4).item()  # (position 0 mattered)


# ---------------------------------------------------------------- loading


# 61 layers (dense but the last: still tiny), DeepSeek-V3's own MTP index, the one mlx-lm's
# deepseek_v3 sanitize drops itself; other depths are left out by specmlx (test_mtp_dense.py)
@pytest.mark.parametrize(
    "config, fp8",
    [(deepseek_v3_config(61, dense=60), True), (glm4_moe_config(2), False)],
    ids=["deepseek_v3", "glm4_moe"],
)
def test_a_raw_checkpoints_head_loads_exactly(tmp_path, specmlx_home, config, fp8):
    model, head = raw_nextn_checkpoint(tmp_path / "m", config, fp8)
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
    save_tiny(tmp_path / "g", {**glm4_moe_config(2), "vocab_size": len(tok)}, tok, 0)
    with pytest.raises(IncompatiblePair, match=r"\(glm4_moe\) has no MTP head"):
        load_pair(str(tmp_path / "g"), "mtp")
