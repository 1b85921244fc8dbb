"""`specmlx distill`: the losses on hand-built arrays, the student cut from its target, the
loss falling on a tiny teacher (and not without training), a resumed run equal to one that
never stopped, on-policy labels equal to a plain pass's, a distilled draft greedy identical
and the CLI's bad input. A distilled draft's whole-sequence chi-square and its wrong-rule
control are test_drafter_kinds.py's."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import DEMO_FACTS, distill_data, distill_teacher, generate, make_tiny, make_tiny_model
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.distill.student import (
    PROMPT_LEN,
    DistillConfig,
    kl_loss,
    make_student,
    pick_blocks,
    sample_rows,
    top_logprobs,
    tvd_loss,
)
from specmlx.distill.train import distill
from specmlx.errors import BadInput
from specmlx.models.loading import Loaded, load_model
from specmlx.models.registry import ModelSpec, load_registry

runner = CliRunner()


# ---------------------------------------------------------------- the losses


def _dist(*p):
    return np.array(p, dtype=np.float64)


def test_the_losses_on_hand_built_arrays():
    """With every id in the top-k, kl_loss is KL(p || q) and tvd_loss is TVD(p, q); with a
    top-1, both are the coarse partition's values {top id, the rest}, lower bounds."""
    p, q = _dist(0.6, 0.3, 0.1, 0.0), _dist(0.25, 0.25, 0.25, 0.25)
    logits = mx.array(np.log(q)[None, None].astype(np.float32))  # (1, 1, V)
    ids = mx.array([[[0, 1, 2, 3]]], dtype=mx.int32)
    logp = mx.array(np.log(np.maximum(p, 1e-30))[None, None].astype(np.float32))
    kl = sum(pi * np.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)
    assert kl_loss(logits, ids, logp).item() == pytest.approx(kl, rel=1e-5)
    assert tvd_loss(logits, ids, logp).item() == pytest.approx(0.4, rel=1e-5)
    # top-1 only: the partition {0, rest}: p = (0.6, 0.4), q = (0.25, 0.75)
    top1, logp1 = ids[..., :1], logp[..., :1]
    coarse = 0.6 * np.log(0.6 / 0.25) + 0.4 * np.log(0.4 / 0.75)
    assert kl_loss(logits, top1, logp1).item() == pytest.approx(coarse, rel=1e-5)
    assert tvd_loss(logits, top1, logp1).item() == pytest.approx(0.35, rel=1e-5)
    assert coarse < kl
    # equal distributions: both zero
    same = mx.array(np.log(p + 1e-9)[None, None].astype(np.float32))
    assert abs(kl_loss(same, ids, logp).item()) < 1e-5
    assert abs(tvd_loss(same, ids, logp).item()) < 1e-5


def test_top_logprobs_are_normalised_over_the_vocabulary():
    logits = mx.array([[2.0, 1.0, 0.0, -1.0]])
    idx, logp = top_logprobs(logits, 2)
    full = np.log(np.exp([2.0, 1.0, 0.0, -1.0]) / np.exp([2.0, 1.0, 0.0, -1.0]).sum())
    assert sorted(idx.tolist()[0]) == [0, 1]
    got = dict(zip(idx.tolist()[0], logp.tolist()[0], strict=True))
    assert got[0] == pytest.approx(full[0], rel=1e-5) and got[1] == pytest.approx(full[1])


def test_blocks_are_picked_evenly():
    assert pick_blocks(30, 4, "spaced") == [0, 10, 19, 29]
    assert pick_blocks(30, 1, "spaced") == [29]
    assert pick_blocks(6, 6, "spaced") == list(range(6))
    assert pick_blocks(30, 3, "first") == [0, 1, 2]


# ---------------------------------------------------------------- a tiny teacher


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Loaded:
    """A tiny 4-block llama with a real tokenizer, its head sharpened so it has preferences."""
    return distill_teacher(tmp_path_factory.mktemp("teacher") / "t", 4)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return distill_data(tmp_path_factory.mktemp("data"))


SMALL = DistillConfig(
    layers=2, steps=30, batch=4, seq_len=32, data_tokens=2048, heldout_tokens=128, lr=3e-3,
    warmup=2, eval_every=0, save_every=0, top_k=64,
)  # fmt: skip


def _run(teacher, out, config, data, **kw):
    return [e for e in distill(teacher, out, config, data, **kw)]


def test_the_student_is_its_targets_blocks(teacher):
    student, config, picks = make_student(teacher, SMALL)
    assert picks == [0, 3] and config["num_hidden_layers"] == 2
    t = dict(tree_flatten(teacher.model.parameters()))
    s = dict(tree_flatten(student.parameters()))
    for src, dst in zip(picks, (0, 1), strict=True):
        w = "self_attn.q_proj.weight"
        assert mx.array_equal(s[f"model.layers.{dst}.{w}"], t[f"model.layers.{src}.{w}"])
    assert mx.array_equal(s["lm_head.weight"], t["lm_head.weight"])
    # only the blocks and the final norm learn: the vocabulary's rows stay the target's
    learn = {k for k, _ in tree_flatten(student.trainable_parameters())}
    assert "lm_head.weight" not in learn and "model.embed_tokens.weight" not in learn
    assert "model.norm.weight" in learn and "model.layers.1.mlp.up_proj.weight" in learn


def test_loss_falls_on_a_tiny_teacher_and_not_without_training(teacher, data, tmp_path):
    trained = _run(teacher, tmp_path / "a", SMALL, data)
    evals = json.loads((tmp_path / "a" / "distill.json").read_text())["evals"]
    before, after = evals[0], evals[-1]
    assert after["kl"] < 0.8 * before["kl"], (before, after)
    assert after["alpha"] > before["alpha"]
    losses = [e.loss for e in trained if e.phase == "train"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])
    # the control: the same run with a learning rate of ~0 leaves the estimate where it was
    still = SMALL.__class__(**{**SMALL.__dict__, "lr": 1e-12})
    _run(teacher, tmp_path / "b", still, data)
    flat = json.loads((tmp_path / "b" / "distill.json").read_text())["evals"]
    assert flat[-1]["kl"] == pytest.approx(flat[0]["kl"], rel=1e-4)
    # the output is a model directory specmlx loads as it loads any other
    student = load_model(load_registry().resolve(str(tmp_path / "a")))
    assert student.config["num_hidden_layers"] == 2


def test_a_resumed_run_has_the_weights_of_one_that_never_stopped(teacher, data, tmp_path):
    config = SMALL.__class__(**{**SMALL.__dict__, "steps": 6, "save_every": 3, "eval_every": 3})
    _run(teacher, tmp_path / "whole", config, data)
    events = distill(teacher, tmp_path / "cut", config, data)
    for e in events:
        if e.phase == "saved":
            break  # interrupted right after the step-3 checkpoint
    events.close()
    assert (tmp_path / "cut" / "checkpoint" / "state.json").is_file()
    assert not (tmp_path / "cut" / "distill.json").exists()
    _run(teacher, tmp_path / "cut", config, data, resume=True)
    whole = mx.load(str(tmp_path / "whole" / "model.safetensors"))
    cut = mx.load(str(tmp_path / "cut" / "model.safetensors"))
    assert whole.keys() == cut.keys()
    assert all(mx.array_equal(whole[k], cut[k]) for k in whole)
    a, b = (json.loads((tmp_path / d / "distill.json").read_text()) for d in ("whole", "cut"))
    assert [e["kl"] for e in a["evals"]] == [e["kl"] for e in b["evals"]]
    # a finished run has nothing to resume, and a checkpoint of another run is refused
    _run(teacher, tmp_path / "x", config, data)
    with pytest.raises(BadInput, match="nothing to resume"):
        _run(teacher, tmp_path / "x", config, data, resume=True)
    events = distill(teacher, tmp_path / "y", config, data)
    next(e for e in events if e.phase == "saved")
    events.close()
    other = config.__class__(**{**config.__dict__, "lr": 1e-3})
    with pytest.raises(BadInput, match="another run .differs in lr"):
        _run(teacher, tmp_path / "y", other, data, resume=True)
    # a crash while swapping checkpoints leaves the old one aside: it is put back
    (tmp_path / "y" / "checkpoint").rename(tmp_path / "y" / ".checkpoint.old")
    assert _run(teacher, tmp_path / "y", config, data, resume=True)[-1].phase == "done"
    assert not list((tmp_path / "y").glob(".*"))  # nothing half-written left in the model dir


def test_held_out_text_is_never_trained_on(teacher, data, tmp_path):
    from specmlx.distill.student import read_data

    rows, held = read_data(data, teacher.tokenizer, SMALL)
    train_text = {tuple(r) for r in rows}
    assert held.size >= SMALL.heldout_tokens and not any(tuple(r) in train_text for r in held)
    one = tmp_path / "one.py"
    one.write_text("\n".join(f"def f{i}(x):\n    return x * {i}" for i in range(400)))
    rows, held = read_data(one, teacher.tokenizer, SMALL)
    both = np.concatenate([rows, held])  # one file: its tail is held out, after the rows
    assert held.size >= SMALL.heldout_tokens and (both[-len(held) :] == held).all()
    assert not any((held[0] == r).all() for r in rows)


def test_families_whose_blocks_differ_by_position_are_cut_or_refused(tmp_path):
    """Gemma 3 sets sliding vs global attention by position: a cut that would turn a global
    block into a sliding one is refused in one line; one that keeps every kind trains."""
    from helpers import save_tiny, tiny_tokenizer

    config = {"model_type": "gemma3_text", "hidden_size": 32, "num_hidden_layers": 6,
              "intermediate_size": 64, "num_attention_heads": 4, "head_dim": 8,
              "num_key_value_heads": 2, "vocab_size": 320, "sliding_window": 8,
              "sliding_window_pattern": 3}  # fmt: skip
    path = save_tiny(tmp_path / "g", config, tiny_tokenizer(), seed=0)
    gemma = load_model(load_registry().resolve(str(path)))
    with pytest.raises(BadInput, match="another kind of block"):
        make_student(gemma, SMALL.__class__(**{**SMALL.__dict__, "layers": 3}))
    ok = SMALL.__class__(**{**SMALL.__dict__, "layers": 3, "init": "first"})
    student, _, picks = make_student(gemma, ok)
    assert picks == [0, 1, 2]
    # the head is the target's own (this checkpoint stores one), not the class's random one
    assert mx.array_equal(student.lm_head.weight, gemma.model.lm_head.weight)


def test_on_policy_labels_are_the_targets_own(teacher, data, tmp_path):
    """--data-from target: the rows are the teacher's samples, and the labels kept while
    sampling (one incremental pass) equal a plain pass over the finished rows."""
    rows = np.array([list(range(3, 3 + 24))] * 2, dtype=np.int32)
    done, toks, idx, logp = next(sample_rows(teacher.model, rows, 8, 2, seed=1))
    assert done == 2 and toks.shape == (2, 24)
    assert (toks[:, :PROMPT_LEN] == rows[:, :PROMPT_LEN]).all()
    assert not (toks == rows).all()  # it wrote its own continuation
    plain_idx, plain_logp = top_logprobs(teacher.model(mx.array(toks)), 8)
    assert np.allclose(np.sort(np.array(logp), -1), np.sort(np.array(plain_logp), -1), atol=1e-4)
    config = SMALL.__class__(**{**SMALL.__dict__, "data_from": "target", "steps": 2})
    assert _run(teacher, tmp_path / "o", config, data)[-1].phase == "done"


# ---------------------------------------------------------------- exactness


def test_a_distilled_draft_is_greedy_identical(teacher, data, tmp_path):
    _run(teacher, tmp_path / "s", SMALL, data)
    draft = load_model(load_registry().resolve(str(tmp_path / "s")))
    prompt = teacher.tokenizer.encode("def add(a, b):\n")
    plain = [e.token for e in generate(teacher.model, None, prompt, max_tokens=40)]
    for k in (1, 3):
        spec = generate(teacher.model, draft.model, prompt, k=k, max_tokens=40)
        events = list(spec)
        assert [e.token for e in events] == plain
        assert any(e.from_draft for e in events)  # the draft's tokens were kept, not just run


# ---------------------------------------------------------------- the CLI


def _distill_cli(*args):
    return runner.invoke(app, ["distill", *map(str, args)])


FAST = ["--layers", "1", "--steps", "2", "--batch", "2", "--seq-len", "16"]
FAST += ["--data-tokens", "64", "--heldout-tokens", "16", "--warmup", "0"]


def test_cli_distills_and_pairs_the_student(tmp_path, specmlx_home, data, monkeypatch):
    target = make_tiny_model(tmp_path / "tgt", num_hidden_layers=3)
    out = tmp_path / "stud"
    r = _distill_cli("--target", target, "--out", out, "--data", data, *FAST)
    assert r.exit_code == 0, r.output
    assert "ready:" in r.output and "held-out: greedy agreement" in r.output
    toml = out / "models.toml"
    assert f'source = "local:{out}"' in toml.read_text()
    monkeypatch.setenv("SPECMLX_MODELS", str(toml))
    args = ["run", "--target", "tgt", "-n", "12", "--temp", "0", "hello"]
    spec = runner.invoke(app, [*args, "--draft", "stud", "-k", "2"])
    plain = runner.invoke(app, [*args, "--draft", "none"])
    assert spec.exit_code == 0 and plain.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    # the same directory again: refused without --resume or --force
    again = _distill_cli("--target", target, "--out", out, "--data", data, *FAST)
    assert again.exit_code == 2 and "--force starts over" in again.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "/no/such/model"], "no such path"),
        (["--data", "/no/such/data"], "no such data"),
        (["--data", "EMPTY"], "not enough text"),
        (["--layers", "9"], "--layers must be 1..3"),
        (["--loss", "l2"], "--loss must be one of kl, tvd"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--name", "a b"], "--name"),
        (["--name", "tgt"], "a name other than its target's"),
        (["--top-k", "100000"], "--top-k must be <= the vocabulary"),
        (["--resume"], "nothing to resume"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, specmlx_home, data, args, message):
    target = make_tiny_model(tmp_path / "tgt", num_hidden_layers=3)
    (tmp_path / "empty").mkdir()
    args = [str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    base = {"--target": str(target), "--out": str(tmp_path / "o"), "--data": str(data)}
    for flag in args:
        base.pop(flag, None)
    r = _distill_cli(*[x for kv in base.items() for x in kv], *FAST, *args)
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], r.output
    assert "Traceback" not in r.output


def test_models_build_cpu_distilled_says_what_it_costs_and_resumes(specmlx_home, monkeypatch):
    """`specmlx models build cpu-distilled`: the demo pair first (its target), then the
    student: its size and time said before it starts, an interrupted build resumed, a built
    one left alone. (The 20-minute run itself is BENCHMARKS.md's, not the suite's.)"""

    from specmlx.distill import train as distill_mod
    from specmlx.models import loading
    from specmlx.standins import cpu_demo as standin
    from specmlx.standins import cpu_distilled

    monkeypatch.setattr(
        standin, "build_demo", lambda **kw: json.loads(DEMO_FACTS) | {"built": False}
    )
    teacher = Loaded(make_tiny(0), None, ModelSpec("smollm2-135m", "gguf", "/x"), {}, 0, 0, 64)
    monkeypatch.setattr(loading, "load_model", lambda spec, progress=None: teacher)
    calls = []

    def fake(teacher, out, config, data, *, resume, force):
        calls.append((teacher.spec.alias, config, data, resume))
        facts = {"picks": [0, 10, 19, 29], "target_layers": 30, "student_params": 4e7,
                 "trained_params": 1.4e7, "train_tokens": 32768, "seconds": 60.0,
                 "evals": [{"greedy": 0.0, "alpha": 0.01, "kl": 13.0}] * 2}  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        (out / "distill.json").write_text(json.dumps(facts))
        yield distill_mod.Event("done", 1, 1, metrics=facts["evals"][-1])

    monkeypatch.setattr(distill_mod, "distill", fake)
    out = cpu_distilled.distilled_dir()
    assert out == specmlx_home / "cpu-distilled" / "draft"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "state.json").write_text("{}")
    r = runner.invoke(app, ["models", "build", "cpu-distilled-draft"])
    assert r.exit_code == 0, r.output
    assert "about 0.2 GB" in r.output and "min on a 2-core" in r.output and "(resuming)" in r.output
    assert calls == [("smollm2-135m", cpu_distilled.CPU_DISTILLED, "stdlib", True)]
    assert "ready: cpu-distilled" in r.output
    again = runner.invoke(app, ["models", "build", "cpu-distilled"])
    assert again.exit_code == 0 and "already built" in again.output and len(calls) == 1
    pair = load_registry().pairs["cpu-distilled"]
    assert (pair.target, pair.draft) == ("cpu-demo-target", "cpu-distilled-draft")
    # the demo target's default draft is still the demo's own
    assert next(p for p in load_registry().pairs.values() if p.target == pair.target).draft == (
        "cpu-demo-draft"
    )
