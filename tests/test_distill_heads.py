"""`specmlx distill --head eagle3|dflash`: the training forwards against the drafters' own
inference (the unrolled EAGLE-3 head step by step against the chained head fed one step at a
time, DFlash's blocks at many anchors against ``DFlashHead.block`` after feeding the context
before each), the saved head read back by the loaders and by the reference code in PyTorch
(the published layout), the loss falling on a tiny teacher and not at a zero learning rate,
a resumed run equal to one that never stopped, greedy identity with a trained head, the
whole-sequence chi-square with its wrong-rule control, and the CLI. Mechanics only: tiny
random targets say nothing about speed or acceptance."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from helpers import DEMO_FACTS, distill_data, distill_teacher, generate, make_tiny_model
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from specmlx.distill.forwards import dflash_blocks, draft_columns, eagle3_steps
from specmlx.distill.heads import head_shape, head_trainee
from specmlx.distill.published import check_head
from specmlx.distill.student import DistillConfig
from specmlx.distill.train import distill
from specmlx.drafting.heads.dflash import load_dflash
from specmlx.drafting.heads.eagle3 import load_eagle3
from specmlx.errors import BadInput
from specmlx.models.loading import Loaded, load_model
from specmlx.models.registry import load_registry

sys.path.insert(0, str(Path(__file__).parent / "reference"))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Loaded:
    """A tiny 8-block llama (EAGLE-3 reads three different layers from 8 on) with a real
    tokenizer, its head sharpened so it has preferences."""
    return distill_teacher(tmp_path_factory.mktemp("teacher") / "t", 8)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return distill_data(tmp_path_factory.mktemp("data"))


def _config(head: str, **over) -> DistillConfig:
    base = dict(
        head=head, layers=1, steps=30, batch=4, seq_len=32, data_tokens=2048,
        heldout_tokens=128, lr=3e-3, warmup=2, eval_every=0, save_every=0, top_k=64,
        depth=3, block=5, draft_vocab=40,
    )  # fmt: skip
    return DistillConfig(**(base | over))


def _rows(teacher, n=4, length=32, seed=0):
    return np.random.default_rng(seed).integers(0, teacher.vocab_size, (n, length)).astype(np.int32)


def _feats(head, n=2, length=12, seed=1):
    width = len(head.reads_hidden) * head.config.target_hidden if hasattr(
        head.config, "target_hidden") else len(head.reads_hidden) * head.config.hidden  # fmt: skip
    return mx.array(np.random.default_rng(seed).normal(size=(n, length, width)).astype(np.float32))


def _randomize(head, seed=3):
    """Random weights everywhere (norms near 1), so every part of the forward matters."""
    rng = np.random.default_rng(seed)
    new = []
    for name, v in tree_flatten(head.trainable_parameters()):
        base = 1.0 if name.endswith("norm.weight") else 0.0
        new.append((name, mx.array((base + 0.3 * rng.normal(size=v.shape)).astype(np.float32))))
    head.load_weights(new, strict=False)
    mx.eval(head.parameters())


# ---------------------------------------------------------------- the training forwards


@pytest.mark.parametrize("width", [0, 32])  # the target's width, and a narrower own space
def test_the_unrolled_eagle3_head_is_the_chained_drafter(teacher, width):
    """Step s of the training forward at index i equals the drafter fed the pairs up to i at
    once, then chained s steps on the true tokens: the same keys, positions and inputs."""
    trainee = head_trainee(teacher, _config("eagle3", width=width), _rows(teacher))
    head = trainee.model
    _randomize(head)
    feats, tokens = _feats(head), mx.array(_rows(teacher, 2, 12, seed=2))
    steps = [np.array(s) for s in eagle3_steps(head, feats, tokens, 3)]
    cols = np.array(draft_columns(head))
    ids = np.nonzero(cols >= 0)[0]
    for b in range(2):
        for i in (0, 4, 8):
            cache = [KVCache()]
            g, logits = head(feats[b : b + 1, : i + 1], tokens[b : b + 1, 1 : i + 2], cache)
            for s in range(3):
                got = np.array(logits[0, -1])[ids]  # over the target's ids, the draft columns
                np.testing.assert_allclose(steps[s][b, i], got, rtol=2e-4, atol=2e-4)
                if s < 2:  # the next step reads this one's output and the token after
                    g, logits = head(g[:, -1:], tokens[b : b + 1, i + 2 + s : i + 3 + s], cache)


def test_dflash_blocks_at_many_anchors_are_the_drafters_blocks(teacher):
    """Every block of the training forward equals DFlashHead.block after feeding the
    context before its anchor to a fresh cache."""
    trainee = head_trainee(teacher, _config("dflash", layers=2, block=5), _rows(teacher))
    head = trainee.model
    _randomize(head)
    feats, tokens = _feats(head, length=16), mx.array(_rows(teacher, 2, 16, seed=2))
    anchors = mx.array([[1, 6, 11], [3, 4, 12]], dtype=mx.int32)
    got = np.array(dflash_blocks(head, feats, tokens, anchors, 5))  # (2, 3, 4, V)
    for b in range(2):
        for a, p in enumerate(np.array(anchors[b]).tolist()):
            cache = head.make_cache()
            want = head.block(feats[b : b + 1, :p], tokens[b, p : p + 1], 5, cache)
            np.testing.assert_allclose(got[b, a], np.array(want[0]), rtol=2e-4, atol=2e-4)


def test_a_head_the_target_cannot_have_is_refused(teacher, tmp_path):
    shallow = dict(teacher.config, num_hidden_layers=4)
    with pytest.raises(BadInput, match="three different"):
        check_head("eagle3", shallow, "t", **head_shape(_config("eagle3"), shallow))
    with pytest.raises(BadInput, match="--layers must be 1"):
        _config("eagle3", layers=2).check(8)
    with pytest.raises(BadInput, match="--seq-len must be past --block"):
        _config("dflash", block=40).check(8)


# ---------------------------------------------------------------- a run


def _run(teacher, out, config, data, **kw):
    return list(distill(teacher, out, config, data, **kw))


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_loss_falls_and_the_saved_head_loads(teacher, data, tmp_path, kind):
    """Training lowers the loss and raises held-out agreement; at a zero learning rate the
    head does not move. The saved directory loads with the drafter's own loader."""
    config = _config(kind, eval_every=30, draft_vocab=0)
    events = _run(teacher, tmp_path / "h", config, data)
    losses = [e.loss for e in events if e.phase == "train"]
    evals = [e.metrics for e in events if e.phase == "eval"]
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    assert evals[-1]["alpha"] > evals[0]["alpha"] + 0.05
    facts = json.loads((tmp_path / "h" / "distill.json").read_text())
    assert facts["kind"] == kind and facts["trained_params"] > 0
    load = load_eagle3 if kind == "eagle3" else load_dflash
    head = load(teacher.model, teacher.config, tmp_path / "h")
    assert head.reads_hidden == tuple(facts["reads"])
    frozen = _run(teacher, tmp_path / "z", DistillConfig(**{**config.__dict__, "lr": 1e-30}), data)
    zero = [e.metrics for e in frozen if e.phase == "eval"]
    assert zero[-1]["alpha"] == pytest.approx(zero[0]["alpha"], abs=1e-6)


# ---------------------------------------------------------------- the published layout


@pytest.mark.parametrize("width", [0, 32])
def test_a_distilled_eagle3_head_runs_in_the_reference_code(teacher, data, tmp_path, width):
    """The saved directory is the published layout: EAGLE's own cnets.py (PyTorch) loads its
    config and tensors (strictly; the target's embedding where none is shipped) and drafts
    what specmlx's loader drafts from it, over a first pass and chained steps."""
    import eagle3_cnets as reference
    import torch
    from kit_eagle3 import agree, our_steps, ref_steps
    from safetensors.torch import load_file

    config = _config("eagle3", width=width, draft_vocab=40, steps=3)
    _run(teacher, tmp_path / "h", config, data)
    published = json.loads((tmp_path / "h" / "config.json").read_text())
    ref = reference.Model(SimpleNamespace(pad_token_id=None, **published)).float().eval()
    state = load_file(str(tmp_path / "h" / "model.safetensors"))
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and missing == ([] if width else ["embed_tokens.weight"])
    if not width:
        embed = np.array(teacher.model.model.embed_tokens.weight)
        ref.embed_tokens.weight.data = torch.tensor(embed)
    head = load_eagle3(teacher.model, teacher.config, tmp_path / "h")
    ids = np.nonzero(np.array(draft_columns(head)) >= 0)[0]
    assert np.array_equal(ids, np.nonzero(state["t2d"].numpy())[0])
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(1, 5, 3 * 64)).astype(np.float32)
    tokens = rng.integers(0, teacher.vocab_size, (1, 5))
    ours = our_steps(head, feats, tokens, [7, 100, 3])
    assert agree(ours, ref_steps(ref, torch.tensor(feats), torch.tensor(tokens), [7, 100, 3]), ids)


def test_a_distilled_dflash_drafter_runs_in_the_reference_code(teacher, data, tmp_path):
    """z-lab's model.py (PyTorch) loads the saved config and tensors strictly and drafts the
    blocks specmlx's loader drafts from them, over rounds of context."""
    import dflash_model as reference
    from kit_dflash import agree, our_rounds, ref_rounds
    from transformers import Qwen3Config

    _run(teacher, tmp_path / "d", _config("dflash", layers=2, block=8, steps=3), data)
    published = json.loads((tmp_path / "d" / "config.json").read_text())
    ref = reference.DFlashDraftModel(Qwen3Config(**published, attn_implementation="eager"))
    from safetensors.torch import load_file

    ref.load_state_dict(load_file(str(tmp_path / "d" / "model.safetensors")), strict=True)
    ref = ref.float().eval()
    head = load_dflash(teacher.model, teacher.config, tmp_path / "d")
    assert list(head.reads_hidden) == published["dflash_config"]["target_layer_ids"]
    feats = np.random.default_rng(0).normal(size=(1, 12, 3 * 64)).astype(np.float32)
    assert agree(our_rounds(head, feats), ref_rounds(ref, teacher.model, feats))


# ---------------------------------------------------------------- resuming, the drafter, the CLI


def test_a_resumed_head_run_has_the_weights_of_one_that_never_stopped(teacher, data, tmp_path):
    """DFlash's per-step anchors come from (seed, step) alone, so a run stopped at a
    checkpoint and resumed trains on the same blocks as one that never stopped."""
    config = _config("dflash", steps=6, save_every=3, eval_every=3)
    _run(teacher, tmp_path / "whole", config, data)
    events = distill(teacher, tmp_path / "cut", config, data)
    next(e for e in events if e.phase == "saved")
    events.close()
    _run(teacher, tmp_path / "cut", config, data, resume=True)
    whole = mx.load(str(tmp_path / "whole" / "model.safetensors"))
    cut = mx.load(str(tmp_path / "cut" / "model.safetensors"))
    assert whole.keys() == cut.keys() and all(mx.array_equal(whole[k], cut[k]) for k in whole)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_a_trained_head_drafts_and_is_greedy_identical(teacher, data, tmp_path, kind):
    config = _config(kind, steps=60, draft_vocab=0)
    _run(teacher, tmp_path / "h", config, data)
    load = load_eagle3 if kind == "eagle3" else load_dflash
    head = load(teacher.model, teacher.config, tmp_path / "h")
    prompt = teacher.tokenizer.encode("def add(a, b):\n")
    plain = [e.token for e in generate(teacher.model, None, prompt, max_tokens=24)]
    spec = [e for e in generate(teacher.model, head, prompt, k=3, max_tokens=24)]
    assert [e.token for e in spec] == plain
    assert sum(e.from_draft for e in spec) > 0  # trained on this text: it drafts some of it


def test_cli_distills_a_head_and_pairs_it(tmp_path, specmlx_home, data, monkeypatch):
    from typer.testing import CliRunner

    from specmlx.cli import app

    runner = CliRunner()
    target = make_tiny_model(tmp_path / "tgt", num_hidden_layers=8)
    out = tmp_path / "e3"
    fast = ["--steps", "2", "--batch", "2", "--seq-len", "16", "--data-tokens", "64",
            "--heldout-tokens", "16", "--warmup", "0"]  # fmt: skip
    args = ["distill", "--target", target, "--out", out, "--data", data, *fast]
    r = runner.invoke(app, [*map(str, args), "--head", "eagle3", "--draft-vocab", "50"])
    assert r.exit_code == 0, r.output
    assert "EAGLE-3 head: reads target layers [1, 3, 4]" in r.output
    assert "by depth" in r.output and "--draft eagle3:e3" in r.output
    monkeypatch.setenv("SPECMLX_MODELS", str(out / "models.toml"))
    run = ["run", "--target", "tgt", "-n", "12", "--temp", "0", "hello"]
    spec = runner.invoke(app, [*run, "--draft", "eagle3:e3", "-k", "2"])
    plain = runner.invoke(app, [*run, "--draft", "none"])
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    paired = runner.invoke(app, ["run", "--target", "tgt", "-n", "4", "--json", "hi"])
    assert paired.exit_code == 0 and json.loads(paired.stdout)["draft"] == "eagle3:e3"
    # what cannot be, in one line before anything trains
    for bad, message in [
        (["--head", "medusa"], "--head must be one of eagle3, dflash"),
        (["--head", "mtp"], "has no MTP head"),  # a llama: no family head to train
        (["--head", "eagle3", "--layers", "2"], "--layers must be 1 for an EAGLE-3 head"),
        (["--head", "dflash", "--block", "1"], "--block must be >= 2"),
        (["--head", "eagle3", "--init", "first"], "--init picks a student's blocks"),
    ]:
        r = runner.invoke(app, [*map(str, args), "--force", *bad])
        errors = [line for line in r.output.splitlines() if line.startswith("error:")]
        assert r.exit_code == 2 and len(errors) == 1 and message in errors[0], r.output
    shallow = make_tiny_model(tmp_path / "shallow", num_hidden_layers=4)
    r = runner.invoke(app, [*map(str, ["distill", "--target", shallow, "--out", tmp_path / "s",
                                       "--data", data, *fast]), "--head", "eagle3"])  # fmt: skip
    assert r.exit_code == 2 and "three different" in r.output, r.output
    assert not (tmp_path / "s").exists()  # refused before the run's directory was made


def test_models_build_cpu_eagle3_trains_the_demo_targets_head(specmlx_home, monkeypatch):
    """`specmlx models build cpu-eagle3`: the demo pair first, then CPU_EAGLE3's run over
    cpu-demo-target, its size and time said before it starts; a built head left alone; the
    pair names it. (The 25-minute run itself is BENCHMARKS.md's, not the suite's.)"""
    from typer.testing import CliRunner

    from specmlx.cli import app
    from specmlx.distill import train as distill_mod
    from specmlx.models import loading
    from specmlx.models.registry import ModelSpec
    from specmlx.standins import cpu_demo as standin
    from specmlx.standins import cpu_distilled

    monkeypatch.setattr(
        standin, "build_demo", lambda **kw: json.loads(DEMO_FACTS) | {"built": False}
    )
    target = Loaded(None, None, ModelSpec("cpu-demo-target", "local", "/x"), {}, 0, 0, 64)
    monkeypatch.setattr(loading, "load_model", lambda spec, progress=None: target)
    calls = []

    def fake(target, out, config, data, *, resume, force):
        calls.append((target.spec.alias, config, data, resume))
        facts = {"kind": "eagle3", "reads": [1, 14, 26], "width": 576, "draft_vocab": 8192,
                 "depth": 3, "head_params": 4e7, "trained_params": 1.2e7, "target_layers": 30,
                 "train_tokens": 16384, "seconds": 60.0,
                 "evals": [{"greedy": 0.0, "alpha": 0.01, "kl": 9.0, "greedy@1": 0.0,
                            "greedy@2": 0.0}] * 2}  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        (out / "distill.json").write_text(json.dumps(facts))
        yield distill_mod.Event("done", 1, 1, metrics=facts["evals"][-1])

    monkeypatch.setattr(distill_mod, "distill", fake)
    runner = CliRunner()
    r = runner.invoke(app, ["models", "build", "cpu-eagle3"])
    assert r.exit_code == 0, r.output
    assert "an EAGLE-3 head (576 wide" in r.output and "min on a 2-core" in r.output
    assert calls == [("cpu-demo-target", cpu_distilled.CPU_EAGLE3, "stdlib", False)]
    assert "EAGLE-3 head: reads target layers [1, 14, 26]" in r.output
    again = runner.invoke(app, ["models", "build", "cpu-eagle3"])
    assert again.exit_code == 0 and "already built" in again.output and len(calls) == 1
    pair = load_registry().pairs["cpu-eagle3"]
    assert (pair.target, pair.draft) == ("cpu-demo-target", "eagle3:cpu-eagle3")
    assert cpu_distilled.eagle3_dir() == specmlx_home / "cpu-eagle3" / "head"


def test_an_mtp_head_trained_for_a_qwen3_5_target_drafts_as_the_checkpoints_own(
    tmp_path, specmlx_home, data, monkeypatch
):
    """`distill --head mtp` on a tiny Qwen3.5 checkpoint: the loss falls, the directory it
    writes is the target with the head (its files linked, the head as mtp.safetensors in the
    checkpoint's own layout, read back by load_mtp equal to what was trained), and
    `run --draft mtp` on it drafts and gives the plain text; a family whose head cannot be
    written back is refused in one line."""
    from families import family_config
    from helpers import save_tiny, tiny_tokenizer
    from typer.testing import CliRunner

    from specmlx.cli import app
    from specmlx.drafting.heads.mtp import checkpoint_tensors, load_mtp

    tok = tiny_tokenizer()
    save_tiny(tmp_path / "q", family_config("qwen3_5", 4, len(tok)), tok, 0)
    runner = CliRunner()
    out = tmp_path / "qm"
    args = ["distill", "--target", str(tmp_path / "q"), "--out", str(out), "--data", str(data),
            "--head", "mtp", "--steps", "40", "--batch", "4", "--seq-len", "32",
            "--data-tokens", "2048", "--heldout-tokens", "128", "--lr", "3e-3", "--warmup", "2",
            "--eval-every", "0", "--save-every", "0", "--top-k", "64"]  # fmt: skip
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "MTP head: reads target layers ['final'], qwen3_5's own layer" in r.output
    facts = json.loads((out / "distill.json").read_text())
    first, last = facts["evals"][0], facts["evals"][-1]
    assert last["alpha"] > first["alpha"] + 0.05 and last["kl"] < first["kl"]
    assert (out / "mtp.safetensors").is_file() and (out / "config.json").is_symlink()
    target = load_model(load_registry().resolve(str(out)))
    head = load_mtp(target.model, target.config, out)
    saved = mx.load(str(out / "mtp.safetensors"))
    assert all(k.startswith("mtp.") for k in saved)
    assert mx.array_equal(head.norm_h.weight, saved["mtp.pre_fc_norm_hidden.weight"])
    q = "layer.self_attn.q_proj.weight"
    assert mx.array_equal(dict(tree_flatten(head.parameters()))[q], saved["mtp.layers.0." + q[6:]])
    raw = checkpoint_tensors(head, raw=True)  # as Hugging Face stores it: norms zero-centred
    assert mx.allclose(raw["mtp.norm.weight"], head.norm.weight - 1.0)
    monkeypatch.setenv("SPECMLX_MODELS", str(out / "models.toml"))
    run = ["run", "--target", "qm", "-n", "16", "--temp", "0", "--json", "def add(a, b):\n"]
    spec = runner.invoke(app, [*run, "--draft", "mtp", "-k", "2"])
    plain = runner.invoke(app, [*run, "--draft", "none"])
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.output
    got = json.loads(spec.stdout)
    assert got["text"] == json.loads(plain.stdout)["text"] and got["stats"]["drafted"] > 0
    assert head.family == "qwen3_5"
    llama = make_tiny_model(tmp_path / "l", num_hidden_layers=8)
    bad = runner.invoke(app, ["distill", "--target", str(llama), "--out", str(tmp_path / "x"),
                              "--data", str(data), "--head", "mtp"])  # fmt: skip
    errors = [line for line in bad.output.splitlines() if line.startswith("error:")]
    assert bad.exit_code == 2 and len(errors) == 1 and "no MTP head" in errors[0], bad.output
