"""EAGLE-3 heads (specmlx/drafting/heads/eagle3.py) against the reference code, and as a drafter.

The reference is SafeAILab/EAGLE's own ``cnets.py`` (tests/reference/eagle3_cnets.py), run
in PyTorch on the CPU on random weights saved in the released layout (config keys and tensor
names as published); which target layers the head reads is checked against Hugging Face's
LlamaModel in PyTorch, picked as EAGLE's ``modeling_llama_kv`` picks them. Then the head as
a drafter on tiny random llamas: greedy identical (one with a draft vocabulary narrower than
the target's), `specmlx run --draft eagle3:PATH`, and each misfit refused in one line
before the target loads. The whole-sequence chi-square and its wrong-rule control are
test_drafter_kinds.py's. Mechanics only: random heads say nothing about speed."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from families import build, family_config
from helpers import generate, save_tiny, served_head_equals_no_draft, tiny_tokenizer
from kit_distribution import JV
from kit_eagle3 import agree, head_json, our_steps, ref_steps, reference_head, save_head
from kit_ranks import same_on_two_ranks
from mlx.utils import tree_flatten
from typer.testing import CliRunner

import specmlx.core.cursor as cursor
import specmlx.drafting.heads.eagle3 as eagle3
import specmlx.models.loading as loading
from specmlx.cli import app
from specmlx.core.hidden import HiddenTap
from specmlx.core.kvstate import KVState
from specmlx.core.stats import Stats
from specmlx.drafting.heads.eagle3 import load_eagle3
from specmlx.errors import BadInput, IncompatiblePair
from specmlx.models.loading import load_pair

LAYERS = 8  # the default layers (1, 3, 4) are three different ones from 8 layers on


def target_config(model) -> dict:
    a = model.args
    return {"model_type": "llama", "hidden_size": a.hidden_size, "vocab_size": a.vocab_size,
            "num_hidden_layers": a.num_hidden_layers}  # fmt: skip


@pytest.fixture(scope="module")
def target():
    return build("llama", LAYERS, 0)


CASES = {
    # SpecForge's layout: its own embedding, a narrower draft vocabulary, layers named
    "specforge": dict(
        ship=True,
        draft_vocab=48,
        over={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}},
    ),  # fmt: skip
    # EAGLE's own: the target's embedding, the whole vocabulary (no d2t in use), default layers
    "eagle": dict(ship=False, draft_vocab=None, over={}),
}


def _case(tmp_path, target, name, seed=1):
    case = CASES[name]
    vocab = target.args.vocab_size
    config = head_json(vocab, draft_vocab=case["draft_vocab"], **case["over"])
    draft_ids = None
    if case["draft_vocab"]:
        draft_ids = np.sort(np.random.default_rng(seed).choice(vocab, case["draft_vocab"], False))
    embed = np.array(target.model.embed_tokens.weight)
    ref = reference_head(config, seed, embed, draft_ids)
    path = save_head(tmp_path / name, ref, config, case["ship"])
    ids = np.arange(vocab) if draft_ids is None else draft_ids
    return path, ref, ids


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_head_matches_the_reference_over_chained_steps(tmp_path, target, name):
    path, ref, ids = _case(tmp_path, target, name)
    head = load_eagle3(target, target_config(target), path)
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(1, 5, 3 * 32)).astype(np.float32)
    tokens = rng.integers(0, 128, (1, 5))
    chained = [7, 100, 3]
    ours = our_steps(head, feats, tokens, chained)
    assert agree(ours, ref_steps(ref, torch.tensor(feats), torch.tensor(tokens), chained), ids)


def _concat_swapped(self, emb, h, mask, cache):
    x = mx.concatenate([self.hidden_norm(h), self.input_layernorm(emb)], axis=-1)
    h = h + self.self_attn(x, mask, cache)
    return h + self.mlp(self.post_attention_layernorm(h))


def _residual_from_x(self, emb, h, mask, cache):
    x = mx.concatenate([self.input_layernorm(emb), self.hidden_norm(h)], axis=-1)
    h = self.hidden_norm(h) + self.self_attn(x, mask, cache)
    return h + self.mlp(self.post_attention_layernorm(h))


def _normed_feed(head_call):
    def call(self, hidden, tokens, cache):  # a chained step fed the normed output
        g, logits = head_call(self, hidden, tokens, cache)
        return self.norm(g), logits

    return call


MUTATIONS = {
    "[h; emb] concatenated": ("_MidLayer", "__call__", lambda orig: _concat_swapped),
    "residual from the normed hidden": ("_MidLayer", "__call__", lambda orig: _residual_from_x),
    "chained on the normed output": ("Eagle3Head", "__call__", _normed_feed),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_changed_layout_detail_fails_the_reference_check(tmp_path, target, mutation, monkeypatch):
    path, ref, ids = _case(tmp_path, target, "specforge")
    cls_name, attr, make = MUTATIONS[mutation]
    cls = getattr(eagle3, cls_name)
    monkeypatch.setattr(cls, attr, make(getattr(cls, attr)))
    head = load_eagle3(target, target_config(target), path)
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(1, 5, 96)).astype(np.float32)
    tokens = rng.integers(0, 128, (1, 5))
    ours = our_steps(head, feats, tokens, [7, 100])
    assert not agree(ours, ref_steps(ref, torch.tensor(feats), torch.tensor(tokens), [7, 100]), ids)


def _hf_hidden_states(target, x: np.ndarray) -> list[torch.Tensor]:
    """Hugging Face's LlamaModel in PyTorch with the target's weights: its hidden_states
    (embeddings, then each layer's output)."""
    from transformers import LlamaConfig, LlamaModel

    a = target.args
    cfg = LlamaConfig(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                      num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
                      num_key_value_heads=a.num_key_value_heads, rms_norm_eps=a.rms_norm_eps,
                      vocab_size=a.vocab_size, rope_theta=a.rope_theta,
                      attn_implementation="eager")  # fmt: skip
    hf = LlamaModel(cfg).float().eval()
    weights = {k.removeprefix("model."): torch.tensor(np.array(v))
               for k, v in tree_flatten(target.parameters()) if k.startswith("model.")}  # fmt: skip
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    with torch.no_grad():
        return list(hf(torch.tensor(x), output_hidden_states=True).hidden_states)


def test_the_target_layers_read_are_the_references(tmp_path, target):
    """EAGLE's modeling_llama_kv keeps the inputs of layers 2, L/2 and L - 3, in that order:
    Hugging Face's hidden_states[2], [L/2] and [L - 3]. The tap's features are those; the
    inputs instead of the outputs (one layer late) are not."""
    path, _, _ = _case(tmp_path, target, "eagle")
    head = load_eagle3(target, target_config(target), path)
    x = np.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    hs = _hf_hidden_states(target, x)
    want = torch.cat([hs[2], hs[LAYERS // 2], hs[LAYERS - 3]], dim=-1).numpy()
    for at, same in ((head.reads_hidden, True), (tuple(i + 1 for i in head.reads_hidden), False)):
        tap = HiddenTap(target, at)
        with tap:
            target(mx.array(x))
        assert np.allclose(np.array(tap.features()), want, atol=1e-4) is same, at


# ---------------------------------------------------------------- as a drafter


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A tiny llama (JV ids) and a random EAGLE-3 head over it whose draft vocabulary lacks
    three of the target's ids (q = 0 there: only the residual can emit them)."""
    target = build("llama", 4, 0, vocab=JV)  # four layers, named: the test's time is passes
    config = head_json(
        JV, draft_vocab=5, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}
    )
    ref = reference_head(config, 4, np.array(target.model.embed_tokens.weight), [0, 1, 3, 5, 6])
    path = save_head(tmp_path_factory.mktemp("e3") / "head", ref, config, ship_embedding=False)
    return target, load_eagle3(target, target_config(target), path)


PROMPT = [3, 5, 1, 3, 6]


@pytest.mark.parametrize("k", [1, 3, "auto"])
@pytest.mark.parametrize("which", ["small", "wide"])
def test_greedy_eagle3_is_token_identical(small, target, tmp_path, which, k):
    if which == "small":
        model, head = small
    else:  # 128 ids, the target's embedding, the default layers
        model, (path, _, _) = target, _case(tmp_path, target, "eagle")
        head = load_eagle3(target, target_config(target), path)
    plain = [e.token for e in generate(model, None, PROMPT, max_tokens=24)]
    stats = Stats()
    spec = list(generate(model, head, PROMPT, k=k, max_tokens=24, stats=stats))
    assert [e.token for e in spec] == plain
    assert stats.drafted > 0 or k == "auto"


# ---------------------------------------------------------------- loading and the CLI


def _on_disk(tmp_path, **head_over):
    """A tiny llama target directory and an EAGLE-3 head directory for it."""
    tok = tiny_tokenizer()
    config = family_config("llama", LAYERS, len(tok))
    save_tiny(tmp_path / "t", config, tok, 0)
    model, _, _ = loading._load_dir(tmp_path / "t")
    hj = head_json(len(tok), **head_over)
    ref = reference_head(hj, 2, np.array(model.model.embed_tokens.weight))
    return tmp_path / "t", save_head(tmp_path / "h", ref, hj, ship_embedding=False)


def test_run_draft_eagle3_and_its_misfits(tmp_path, specmlx_home, monkeypatch):
    t, h = _on_disk(tmp_path)
    runner = CliRunner()
    args = ["run", "--target", str(t), "-k", "2", "-n", "12", "--temp", "0", "--json", "hello"]
    ok = runner.invoke(app, [*args[:3], "--draft", f"eagle3:{h}", *args[3:]])
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.stdout)
    assert out["draft"] == "eagle3:h" and out["stats"]["drafted"] > 0
    plain = runner.invoke(app, [*args[:3], "--draft", "none", *args[3:]])
    assert json.loads(plain.stdout)["text"] == out["text"]
    _, d, shared = load_pair(str(t), f"eagle3:{h}")
    assert d.identity.startswith(f"{_.identity}|eagle3|") and shared == _.vocab_size

    def never(*a, **k):
        raise AssertionError("the target loaded before the head was checked")

    monkeypatch.setattr(loading, "load_model", never)
    misfits = {
        "wide": (dict(target_hidden_size=48), "reads hidden states 48 wide; the target's are 32"),
        "vocab": (dict(vocab_size=99), "maps into 99 ids; the target's vocabulary has"),
        "deep": (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}),
                 "reads target layers [1, 3, 8]; the target has 8"),
        "kind": (dict(architectures=["LlamaForCausalLM"]), "is not an EAGLE-3 head"),
    }  # fmt: skip
    for name, (over, says) in misfits.items():
        cfg = json.loads((h / "config.json").read_text()) | over
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(cfg))
        (bad / "model.safetensors").symlink_to(h / "model.safetensors")
        r = runner.invoke(app, ["run", "--target", str(t), "--draft", f"eagle3:{bad}", "x"])
        assert r.exit_code == 2, (name, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (name, lines)
        with pytest.raises((IncompatiblePair, BadInput), match="EAGLE-3|wide|ids|layers"):
            load_pair(str(t), f"eagle3:{bad}")
    empty = runner.invoke(app, ["run", "--target", str(t), "--draft", "eagle3:", "x"])
    assert empty.exit_code == 2 and "needs the head after the colon" in empty.output


def test_serve_with_an_eagle3_head_equals_no_draft(tmp_path):
    t, h = _on_disk(tmp_path)
    served_head_equals_no_draft(tmp_path, t, f"eagle3:{h}", 2)


def _offline_keys(target, head, ctx, fed, at=None):
    """The head's attention keys after feeding it the pairs (f_j, t_{j+1}), j < fed, with f
    from one fresh target pass over ctx at the head's layers (or ``at``)."""
    tap = HiddenTap(target, at or head.reads_hidden)
    with tap:
        target(mx.array(ctx)[None])
    cache = head.make_cache()
    head(tap.features()[:, :fed], mx.array(ctx[1 : fed + 1])[None], cache)
    return cache[0].state[0][..., :fed, :]


def test_the_head_is_fed_the_right_features_and_token(tmp_path, target, monkeypatch):
    """After a generation (prompt cache included) the head's cache holds exactly what
    feeding it the aligned pairs gives; features one position late, or its three layers in
    another order, are caught by the same comparison."""
    path, _, _ = _case(tmp_path, target, "specforge")
    head = load_eagle3(target, target_config(target), path)
    prompt = [5, 9, 2, 77, 31, 4, 8]
    kv = KVState()
    out = [e.token for e in generate(target, head, prompt, k=3, max_tokens=16, kv=kv)]
    more = prompt + out + [11, 12]  # the next request extends the first: caches reused
    out2 = [e.token for e in generate(target, head, more, k=3, max_tokens=8, kv=kv)]
    ctx, fed = more + out2, kv.draft_held
    assert fed >= len(more) - 1
    got = kv.draft[0].state[0][..., :fed, :]
    assert mx.allclose(got, _offline_keys(target, head, ctx, fed), atol=1e-4).item()
    swapped = tuple(reversed(head.reads_hidden))
    assert not mx.allclose(got, _offline_keys(target, head, ctx, fed, swapped), atol=1e-4).item()
    late = cursor.hidden_states
    monkeypatch.setattr(
        cursor, "hidden_states", lambda tap: (lambda r: mx.concatenate([r[:1], r[:-1]]))(late(tap))
    )
    kv = KVState()
    out = [e.token for e in generate(target, head, prompt, k=3, max_tokens=16, kv=kv)]
    got = kv.draft[0].state[0][..., : kv.draft_held, :]
    want = _offline_keys(target, head, prompt + out, kv.draft_held)
    assert not mx.allclose(got, want, atol=1e-4).item()


def test_two_ranks_with_an_eagle3_head_equal_one_process(tmp_path):
    """The target split over two local ranks (mlx-lm's shard), the head replicated on each:
    greedy at a fixed k, the same tokens as one process, and every round drafted and kept
    the same tokens, so each rank's head read the same (whole) hidden states."""
    t, h = _on_disk(tmp_path)
    one = same_on_two_ranks(tmp_path, t, f"eagle3:{h}", 2)
    assert one["draft"] == "eagle3:h" and one["stats"]["drafted"] > 0
