"""DFlash block drafters (specmlx/drafting/heads/dflash.py) against the reference code, and as a
drafter.

The reference is z-lab/dflash's own ``model.py`` (tests/reference/dflash_model.py), run in
PyTorch on the CPU on random weights saved in the released layout (config keys and tensor
names as published): the drafter's logits over several rounds of context and blocks, and
the reference's whole generation loop (``dflash_generate``) over Hugging Face's Qwen3 with
the target's weights, whose every block must be the one specmlx drafts. Then the drafter on
tiny random targets: greedy identical (window and recurrent targets too), `specmlx run` and
`serve` with ``--draft dflash:PATH``, and each misfit refused in one line before the target
loads. The whole-sequence chi-square and its wrong-rule control are test_drafter_kinds.py's.
Mechanics only: random drafters say nothing about speed."""

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from families import build, family_config
from helpers import generate, save_tiny, served_head_equals_no_draft, tiny_tokenizer
from kit_dflash import ROUNDS, LegacyCache, agree, our_rounds, ref_rounds
from kit_eagle3 import random_weights
from kit_ranks import same_on_two_ranks
from mlx.utils import tree_flatten
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM
from typer.testing import CliRunner

import specmlx.drafting.heads.dflash as dflash
import specmlx.models.loading as loading
from specmlx.cli import app
from specmlx.core.hidden import HiddenTap, text_model
from specmlx.core.kvstate import KVState
from specmlx.core.stats import Stats
from specmlx.drafting.heads.dflash import load_dflash
from specmlx.errors import BadInput, IncompatiblePair
from specmlx.models.loading import load_pair

sys.path.insert(0, str(Path(__file__).parent / "reference"))
import dflash_model as reference  # noqa: E402

LAYERS = 8  # the target's; the default ids for 2 draft layers are then [1, 5]


def dflash_json(vocab: int, layers: int = 2, block: int = 8, target_layers=None, **over) -> dict:
    """A DFlash config.json as the published drafters have it (z-lab/Qwen3-8B-DFlash-b16:
    a Qwen3Config with block_size, num_target_layers and dflash_config)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "vocab_size": vocab,
        "layer_types": ["full_attention"] * layers,
        "block_size": block,
        "num_target_layers": LAYERS,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": target_layers},
        "torch_dtype": "float32",
        **over,
    }


def reference_drafter(config: dict, seed: int):
    """The reference DFlashDraftModel on random weights (norms too, so their places matter)."""
    torch.manual_seed(seed)
    cfg = dict(config)
    if cfg["dflash_config"].get("target_layer_ids") is None:
        cfg["dflash_config"] = {"mask_token_id": cfg["dflash_config"]["mask_token_id"]}
    model = reference.DFlashDraftModel(Qwen3Config(**cfg, attn_implementation="eager"))
    return random_weights(model.float().eval())


def save_drafter(path: Path, model, config: dict) -> Path:
    """The reference model's weights as the released drafters lay them out."""
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def target_config(model) -> dict:
    a = model.args
    return {"model_type": "qwen3", "hidden_size": a.hidden_size, "vocab_size": a.vocab_size,
            "num_hidden_layers": a.num_hidden_layers}  # fmt: skip


@pytest.fixture(scope="module")
def target():
    return build("qwen3", LAYERS, 0)


def _case(tmp_path, target, seed=1, **over):
    config = dflash_json(target.args.vocab_size, **over)
    ref = reference_drafter(config, seed)
    return save_drafter(tmp_path / f"d{seed}", ref, config), ref


def _feats(head, seed=0):
    n = sum(r[0] for r in ROUNDS)
    width = len(head.reads_hidden) * 32
    return np.random.default_rng(seed).normal(size=(1, n, width)).astype(np.float32)


@pytest.mark.parametrize("layers", [1, 2])
def test_the_drafter_matches_the_reference_over_rounds(tmp_path, target, layers):
    path, ref = _case(tmp_path, target, layers=layers)
    head = load_dflash(target, target_config(target), path)
    assert head.reads_hidden == ((LAYERS // 2,) if layers == 1 else (1, 5))
    feats = _feats(head)
    assert agree(our_rounds(head, feats), ref_rounds(ref, target, feats))


def _causal(self, x, cache):  # the block attending causally, as an autoregressive draft does
    b, n, _ = x.shape
    at = cache.offset
    q = self.q_norm(self.q_proj(x).reshape(b, n, self.heads, -1)).transpose(0, 2, 1, 3)
    q = self.rope(q, offset=at)
    k, v = self._kv(x, at)
    if at:
        held_k, held_v = cache.keys[..., :at, :], cache.values[..., :at, :]
        k, v = mx.concatenate([held_k, k], axis=2), mx.concatenate([held_v, v], axis=2)
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask="causal")
    return self.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _no_k_norm(orig):
    def kv(self, x, offset):
        b, n, _ = x.shape
        k = self.k_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return self.rope(k, offset=offset), v

    return kv


def _context_through_norm(orig):
    def call(self, hidden, tokens, cache):
        c = self.fc(hidden)  # hidden_norm left out
        for layer, lc in zip(self.layers, cache, strict=True):
            layer.self_attn.feed(layer.input_layernorm(c), lc)

    return call


MUTATIONS = {
    "a causal block": ("_Attention", "__call__", lambda orig: _causal),
    "no k_norm": ("_Attention", "_kv", _no_k_norm),
    "the context input_layernorm'd, not hidden_norm'd": (
        "DFlashHead",
        "__call__",
        _context_through_norm,
    ),  # fmt: skip
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_changed_layout_detail_fails_the_reference_check(tmp_path, target, mutation, monkeypatch):
    path, ref = _case(tmp_path, target)
    cls_name, attr, make = MUTATIONS[mutation]
    cls = getattr(dflash, cls_name)
    monkeypatch.setattr(cls, attr, make(getattr(cls, attr)))
    head = load_dflash(target, target_config(target), path)
    feats = _feats(head)
    assert not agree(our_rounds(head, feats), ref_rounds(ref, target, feats))


def _hf_qwen3(target) -> Qwen3ForCausalLM:
    """Hugging Face's Qwen3 in PyTorch with the target's weights."""
    a = target.args
    cfg = Qwen3Config(hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                      num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
                      num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim,
                      rms_norm_eps=a.rms_norm_eps, vocab_size=a.vocab_size, rope_theta=a.rope_theta,
                      tie_word_embeddings=False, attn_implementation="eager")  # fmt: skip
    hf = Qwen3ForCausalLM(cfg).float().eval()
    weights = {k: torch.tensor(np.array(v)) for k, v in tree_flatten(target.parameters())}
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m]
    return hf


def _their_blocks(ref, hf, prompt, n, monkeypatch) -> tuple[list, dict]:
    """The reference's own generation loop, greedy: its output ids and every block its
    drafter proposed (the argmax it writes into the block), by the block's first position."""
    blocks = {}

    def record(m, args, kwargs, out):
        at = int(kwargs["position_ids"][0, -ref.block_size])
        blocks[at] = hf.lm_head(out[:, 1 - ref.block_size :]).argmax(-1)[0].tolist()

    monkeypatch.setattr(reference, "_cuda_time", lambda: 0.0)
    monkeypatch.setattr(reference, "DynamicCache", LegacyCache)
    hook = ref.register_forward_hook(record, with_kwargs=True)
    try:
        got = reference.dflash_generate(ref, hf, torch.tensor([prompt]), n, None, 0.0)
    finally:
        hook.remove()
    return got[0, len(prompt) :].tolist(), blocks


def test_specmlx_drafts_the_reference_loops_blocks(tmp_path, target, monkeypatch):
    """Every block the reference's dflash_generate drafts over Hugging Face's Qwen3 (the
    target's weights) is the block specmlx drafts at the same round, and both generate the
    target's greedy text: which layers are read, how the context is fed and where the block
    sits all agree with the reference loop, not with ourselves. A drafter reading the layers
    in another order is caught by the same comparison."""
    path, ref = _case(tmp_path, target, layers=2, target_layers=[2, 6])
    hf = _hf_qwen3(target)
    prompt, n = [5, 9, 2, 77, 31, 4, 8, 40, 13], 40
    want, theirs = _their_blocks(ref, hf, prompt, n, monkeypatch)

    def ours(head):
        blocks, block = {}, head.block

        def record(hidden, first, width, cache):
            at = cache[0].offset + (0 if hidden is None else hidden.shape[1])
            logits = block(hidden, first, width, cache)
            if width == ref.block_size:
                blocks[at] = np.array(logits.argmax(-1))[0].tolist()
            return logits

        head.block = record
        out = [e.token for e in generate(target, head, prompt, k=7, max_tokens=n)]
        return out, blocks

    out, blocks = ours(load_dflash(target, target_config(target), path))
    assert out == want[:n]
    # (specmlx's first block starts at the prompt's last token, the reference's one later:
    # blocks are compared where they start at one position)
    common = sorted(set(blocks) & set(theirs))
    assert len(common) >= 8 and all(blocks[p] == theirs[p] for p in common), common
    cfg = json.loads((path / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [6, 2]
    (path / "config.json").write_text(json.dumps(cfg))
    _, swapped = ours(load_dflash(target, target_config(target), path))  # the same fc
    assert any(swapped[p] != theirs[p] for p in common if p in swapped)


# ---------------------------------------------------------------- as a drafter


PROMPT = [3, 5, 1, 3, 6]


@pytest.mark.parametrize("k", [1, 3, 7, "auto"])
def test_greedy_dflash_is_token_identical(target, tmp_path, k):
    path, _ = _case(tmp_path, target)
    head = load_dflash(target, target_config(target), path)
    plain = [e.token for e in generate(target, None, PROMPT, max_tokens=24)]
    stats = Stats()
    spec = list(generate(target, head, PROMPT, k=k, max_tokens=24, stats=stats))
    assert [e.token for e in spec] == plain
    assert stats.drafted > 0 or k == "auto"


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "gemma3_text"])
def test_greedy_dflash_on_window_and_recurrent_targets(family):
    """A random drafter built straight from its config (its math is checked above) over
    targets whose caches are a sliding window or recurrent state: the rounds roll the
    target back exactly, so the output is the target's."""
    model = build(family, 4, 0)
    config = dflash.DFlashConfig(
        hidden=model_width(model), layers=1, heads=4, kv_heads=2, head_dim=8, bias=False,
        intermediate=64, eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_positions=512,
        vocab=128, block_size=6, mask_id=127, target_layers=(0, 2),
    )  # fmt: skip
    head = dflash.DFlashHead(model, config)
    mx.eval(head.parameters())
    prompt = [5, 9, 2, 77, 31, 4, 8, 40, 13, 21, 6, 3]  # past the stand-ins' window of 8
    plain = [e.token for e in generate(model, None, prompt, max_tokens=24)]
    stats = Stats()
    spec = [e.token for e in generate(model, head, prompt, k=5, max_tokens=24, stats=stats)]
    assert spec == plain and stats.drafted > 0


def model_width(model) -> int:
    return text_model(model).embed_tokens.weight.shape[1]


def _offline_keys(target, head, ctx, fed):
    """Each draft layer's context keys after feeding it the features of one fresh target
    pass over ctx, positions < fed."""
    tap = HiddenTap(target, head.reads_hidden)
    with tap:
        target(mx.array(ctx)[None])
    cache = head.make_cache()
    head(tap.features()[:, :fed], None, cache)
    return [c.keys[..., :fed, :] for c in cache]


def test_the_context_fed_is_the_targets_through_a_prompt_cache(tmp_path, target):
    """After a generation and a second request that reuses its caches, each layer's context
    cache holds exactly what feeding one fresh pass's features gives."""
    path, _ = _case(tmp_path, target)
    head = load_dflash(target, target_config(target), path)
    prompt = [5, 9, 2, 77, 31, 4, 8]
    kv = KVState()
    out = [e.token for e in generate(target, head, prompt, k=5, max_tokens=16, kv=kv)]
    more = prompt + out + [11, 12]
    out2 = [e.token for e in generate(target, head, more, k=5, max_tokens=8, kv=kv)]
    fed = kv.draft_held
    assert fed >= len(more) - 1
    want = _offline_keys(target, head, more + out2, fed)
    for c, w in zip(kv.draft, want, strict=True):
        assert mx.allclose(c.keys[..., :fed, :], w, atol=1e-4).item()


# ---------------------------------------------------------------- loading and the CLI


def _on_disk(tmp_path, **over):
    """A tiny qwen3 target directory and a DFlash drafter directory for it."""
    tok = tiny_tokenizer()
    save_tiny(tmp_path / "t", family_config("qwen3", LAYERS, len(tok)), tok, 0)
    cfg = dflash_json(len(tok), **over)
    return tmp_path / "t", save_drafter(tmp_path / "d", reference_drafter(cfg, 2), cfg)


def test_run_draft_dflash_and_its_misfits(tmp_path, specmlx_home, monkeypatch):
    t, d = _on_disk(tmp_path)
    runner = CliRunner()
    args = ["run", "--target", str(t), "-k", "3", "-n", "12", "--temp", "0", "--json", "hello"]
    ok = runner.invoke(app, [*args[:3], "--draft", f"dflash:{d}", *args[3:]])
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.stdout)
    assert out["draft"] == "dflash:d" and out["stats"]["drafted"] > 0
    plain = runner.invoke(app, [*args[:3], "--draft", "none", *args[3:]])
    assert json.loads(plain.stdout)["text"] == out["text"]
    tl, dl, shared = load_pair(str(t), f"dflash:{d}")
    assert dl.identity.startswith(f"{tl.identity}|dflash|") and shared == tl.vocab_size

    def never(*a, **k):
        raise AssertionError("the target loaded before the drafter was checked")

    monkeypatch.setattr(loading, "load_model", never)
    misfits = {
        "wide": (dict(hidden_size=48), "is 48 wide; the target's hidden states are 32"),
        "vocab": (dict(vocab_size=99), "drafts over 99 ids; the target's vocabulary has"),
        "deep": (dict(dflash_config={"mask_token_id": 3, "target_layer_ids": [1, 8]}),
                 "reads target layers [1, 8]; the target has 8"),
        "other": (dict(num_target_layers=36), "made for a target of 36 layers; this one has 8"),
        "kind": (dict(architectures=["Qwen3ForCausalLM"]), "is not a DFlash drafter"),
        "window": (dict(layer_types=["sliding_attention", "full_attention"]), "sliding-window"),
    }  # fmt: skip
    for name, (over, says) in misfits.items():
        cfg = json.loads((d / "config.json").read_text()) | over
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(cfg))
        (bad / "model.safetensors").symlink_to(d / "model.safetensors")
        r = runner.invoke(app, ["run", "--target", str(t), "--draft", f"dflash:{bad}", "x"])
        assert r.exit_code == 2, (name, r.output)
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], (name, lines)
        with pytest.raises((IncompatiblePair, BadInput), match="DFlash|wide|ids|layers|sliding"):
            load_pair(str(t), f"dflash:{bad}")
    empty = runner.invoke(app, ["run", "--target", str(t), "--draft", "dflash:", "x"])
    assert empty.exit_code == 2 and "needs the head after the colon" in empty.output


def test_bench_and_serve_with_a_dflash_drafter(tmp_path, specmlx_home):
    """`specmlx bench --draft dflash:PATH` runs its rows; the official openai client against
    `specmlx serve --draft dflash:PATH` gets the greedy text of no draft, and a request that
    extends an earlier one starts on its caches."""
    t, d = _on_disk(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"name": "a", "prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "--target", str(t), "--draft", f"dflash:{d}",
                                 "--prompts", str(prompts), "-n", "12", "--repeats", "1",
                                 "-k", "3,auto", "--temp", "0", "--json", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    rows = {(r["system"], r["drafter"], r["k"]): r for r in result["rows"]}
    assert {("specmlx", "dflash:d", 3), ("specmlx", "dflash:d", "auto")} <= set(rows), rows
    assert all(r["same_as_target"] == "identical" for r in rows.values()), rows
    assert sum(r["drafted"] for r in result["runs"] if "dflash" in r["label"]) > 0
    assert result["draft_cost"] > 0  # a block's seconds per draft, against a target pass
    served_head_equals_no_draft(tmp_path, t, f"dflash:{d}", 3)


def test_two_ranks_with_a_dflash_drafter_equal_one_process(tmp_path):
    """The target split over two local ranks (mlx-lm's shard), the drafter replicated on
    each: greedy at a fixed k, the same tokens as one process, and every round drafted and
    kept the same tokens, so each rank's drafter read the same (whole) hidden states."""
    t, d = _on_disk(tmp_path)
    one = same_on_two_ranks(tmp_path, t, f"dflash:{d}", 3)
    assert one["draft"] == "dflash:d" and one["stats"]["drafted"] > 0
