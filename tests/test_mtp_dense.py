"""Checkpoints that carry their MTP heads over dense main layers (no experts). mlx-lm's own
sanitize drops a head's tensors only on some paths (Qwen3-Next's only when it finds
per-expert tensors to stack, DeepSeek-V3's only at layer 61, its own model's MTP index), so
the rest failed with "parameters not in model: mtp.fc.weight, ..."; specmlx now drops every
head's tensors before mlx-lm sees them (mtp.without_head, through loading._load_dir). Each
family's checkpoint loads as a target that decodes as the same model saved without them, and
its head still loads from the same files as a draft."""

import json
import shutil

import mlx.core as mx
import pytest
from families import family_config
from helpers import save_tiny, tiny_tokenizer
from kit_mtp import (
    QWEN_HF_NAMES,
    deepseek_v3_config,
    glm4_moe_config,
    nextn_layout,
    random_head,
    tokens,
)
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.drafting.heads.mtp import FAMILIES, without_head
from specmlx.models.loading import _load_dir, load_pair

PROMPT = [5, 6, 7, 8, 9, 10]


def _qwen(family: str) -> dict:
    config = {**family_config("qwen3_next" if family == "qwen3_next" else "qwen3_5", 2)}
    config["model_type"] = family
    text = config.get("text_config", config)
    text["num_experts"] = 0  # every layer (and the head's) a plain MLP
    if family == "qwen3_next":
        text["num_nextn_predict_layers"] = 1
    else:
        text["mtp_num_hidden_layers"] = 1
    return config


# each family with a head specmlx knows, its main layers and its head's layer dense
DENSE = {
    "qwen3_next": _qwen("qwen3_next"),
    "qwen3_5": _qwen("qwen3_5"),
    "qwen3_5_moe": _qwen("qwen3_5_moe"),
    "deepseek_v3": deepseek_v3_config(2, dense=3),
    "glm4_moe": {**glm4_moe_config(2), "first_k_dense_replace": 3},
}


def test_every_known_family_is_covered():
    assert set(DENSE) == set(FAMILIES)


def _head_tensors(family: str, head, config: dict, target_weights: dict) -> dict[str, mx.array]:
    """The head's parameters named as a converted checkpoint keeps them (norms as they
    are), and a second MTP layer's copy beside it (checkpoints may ship several; only the
    first is read, every one must be dropped from the target's load)."""
    out = {}
    if family.startswith("qwen"):
        for k, v in tree_flatten(head.parameters()):
            first, rest = k.split(".", 1)
            out[f"mtp.{QWEN_HF_NAMES[first]}.{rest}"] = v
            if first == "layer":
                out[f"mtp.layers.1.{rest}"] = v
        return out
    n = config["num_hidden_layers"]
    layer = nextn_layout(head)
    # the head's copies of the target's embedding and LM head (not read, dropped all the same)
    layer["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"]
    layer["shared_head.head.weight"] = target_weights["lm_head.weight"]
    for k, v in layer.items():
        out[f"model.layers.{n}.{k}"] = v
        out[f"model.layers.{n + 1}.{k}"] = v
    return out


def _checkpoints(root, family: str, seed: int = 0):
    """A tiny dense ``family`` model saved twice by mlx-lm: ``plain`` as saved, ``headed``
    the same with a random MTP head's tensors added; returns both paths and the head."""
    tok = tiny_tokenizer()
    config = json.loads(json.dumps(DENSE[family]))
    config.get("text_config", config)["vocab_size"] = len(tok)
    plain, headed = root / "plain", root / "headed"
    save_tiny(plain, config, tok, seed)
    shutil.copytree(plain, headed)
    model, _, _ = _load_dir(plain)
    head = random_head(model, family, seed=seed + 5)
    assert not any("switch_mlp" in k for k, _ in tree_flatten(head.parameters()))  # dense
    weights = dict(mx.load(str(headed / "model.safetensors")))
    mx.save_safetensors(
        str(headed / "model.safetensors"), weights | _head_tensors(family, head, config, weights)
    )
    return plain, headed, head


@pytest.mark.parametrize("family", list(DENSE))
def test_a_dense_checkpoint_with_heads_loads_and_decodes_as_without(tmp_path, specmlx_home, family):
    plain, headed, head = _checkpoints(tmp_path, family)
    want, _, _ = load_pair(str(plain))
    target, _, _ = load_pair(str(headed))  # mlx-lm refused Qwen3-Next's and DeepSeek's here
    assert "sanitize" not in vars(target.model)  # the family's own again after the load
    got = dict(tree_flatten(target.model.parameters()))
    assert got.keys() == dict(tree_flatten(want.model.parameters())).keys()
    plain_tokens = tokens(want.model, None, PROMPT, k=0, max_tokens=24)
    assert tokens(target.model, None, PROMPT, k=0, max_tokens=24) == plain_tokens
    # the head, from the same files, as a draft: exact, and greedy still the target's
    target, draft, _ = load_pair(str(headed), "mtp")
    loaded = dict(tree_flatten(draft.model.parameters()))
    for k, v in tree_flatten(head.parameters()):
        assert mx.allclose(loaded[k], v, atol=1e-6).item(), k
    drafted = tokens(target.model, draft.model, PROMPT, k=3, max_tokens=24)
    assert drafted == plain_tokens


def test_run_draft_mtp_on_a_dense_qwen3_next(tmp_path, specmlx_home):
    """The issue's case from the command line: the checkpoint with its head decodes as the
    one without, with --draft none and with --draft mtp (which drafts)."""
    plain, headed, _ = _checkpoints(tmp_path, "qwen3_next")
    runner = CliRunner()
    args = ["run", "-n", "12", "--temp", "0", "--json", "hello"]
    outs = {}
    for name, path, draft in (("plain", plain, "none"), ("none", headed, "none"),
                              ("mtp", headed, "mtp")):  # fmt: skip
        r = runner.invoke(app, [*args, "--target", str(path), "--draft", draft, "-k", "2"])
        assert r.exit_code == 0, r.stderr
        outs[name] = json.loads(r.stdout)
    assert outs["plain"]["text"] == outs["none"]["text"] == outs["mtp"]["text"]
    assert outs["mtp"]["draft"].endswith(":mtp") and outs["mtp"]["stats"]["drafted"] > 0


@pytest.mark.parametrize(
    "family, head, kept",
    [
        ("qwen3_next", ["mtp.fc.weight", "mtp.layers.1.mlp.up_proj.weight"],
         ["model.layers.1.mlp.up_proj.weight", "lm_head.weight"]),
        ("qwen3_5", ["mtp.fc.weight", "model.language_model.mtp.norm.weight"],
         ["model.language_model.layers.0.mlp.up_proj.weight", "model.visual.blocks.0.mlp.weight"]),
        ("deepseek_v3", ["model.layers.2.eh_proj.weight", "model.layers.3.enorm.weight",
                         "model.layers.2.mlp.experts.0.up_proj.weight_scale_inv"],
         ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.kv_b_proj.weight"]),
        ("glm4_moe", ["model.layers.2.shared_head.norm.weight"],
         ["model.layers.1.mlp.gate_proj.weight", "model.norm.weight"]),
    ],
)  # fmt: skip
def test_without_head_drops_exactly_the_heads_tensors(family, head, kept):
    """Every MTP layer's tensors go (not only the first's), under a wrapper's prefix too;
    the main model's stay, whatever their layer."""
    config = json.loads(json.dumps(DENSE[family]))
    module = __import__(f"mlx_lm.models.{family}", fromlist=["Model"])
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = {k: mx.zeros(1) for k in head + kept}
    assert sorted(without_head(model, config, weights)) == sorted(kept)
    other = {"model_type": "llama"}  # a family with no known head: nothing dropped
    assert without_head(model, other, weights).keys() == weights.keys()
