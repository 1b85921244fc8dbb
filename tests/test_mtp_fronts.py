"""`--draft mtp` through the front ends: `specmlx serve` (the official openai client),
`specmlx bench` and `specmlx run` over two local ranks with the target split. One tiny
Qwen3.5 checkpoint in Hugging Face's raw layout (kit_mtp.raw_checkpoint) whose head is made
to be right some of the time, so rounds keep none, some and all of their drafts."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import openai
import pytest
from helpers import Server, make_tiny_model
from kit_mtp import deepseek_v3_config, glm4_moe_config, raw_checkpoint, raw_nextn_checkpoint
from kit_ranks import TWO, specmlx, tokens
from kit_serve import local_json, server_env
from typer.testing import CliRunner

from specmlx.cli import app

FIRST = "def add(a, b):\n"
PROMPT = FIRST + "    return"
KEY = "sk-test-key"


def _bigram_head(path: Path) -> None:
    """Rewrite the checkpoint's head (raw names and layout) so that it drafts what a tiny
    random target mostly predicts from its newest token alone: fc reads the token's embedding
    (the hidden state at a small weight, so it still counts), the decoder layer is the
    identity (its output projections zero) and the norms are plain (stored zero-centred: 0 is
    a weight of 1). A random head is almost never right (its rounds keep no draft), which would
    leave the rounds that keep some or all drafts untested."""
    file = path / "model.safetensors"
    w = dict(mx.load(str(file)))
    h = w["mtp.fc.weight"].shape[0]
    eye = mx.eye(h, dtype=w["mtp.fc.weight"].dtype)
    w["mtp.fc.weight"] = mx.concatenate([eye, 0.3 * eye], axis=1)  # [embedding, hidden]
    for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
        w[name] = mx.zeros_like(w[name])
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w[f"mtp.{name}.weight"] = mx.zeros_like(w[f"mtp.{name}.weight"])
    mx.save_safetensors(str(file), w)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The checkpoint under root/q and an empty root/models.toml: the shipped registry alone
    (kit_serve's server_env and local_json read that file)."""
    root = tmp_path_factory.mktemp("mtp-fronts")
    raw_checkpoint(root / "q")
    _bigram_head(root / "q")
    (root / "models.toml").write_text("")
    return root


@pytest.fixture(scope="module")
def env(root) -> dict:
    env = server_env(root, root / "models.toml")
    env.pop("MLX_RANK", None)  # a rank's own variable: never inherited by the launcher
    return env


def mtp_run(root: Path, *args: str) -> dict:
    """`specmlx run --json` in this process, greedy, on the checkpoint."""
    return local_json(root, "--target", str(root / "q"), "--temp", "0", *args)


def test_the_head_drafts_and_greedy_is_exact_in_one_process(root):
    """The reference for the front ends below: the head drafts, some drafts are kept (rounds
    keeping none, one and two of k = 2), and the text is the target's alone."""
    mtp = mtp_run(root, "--draft", "mtp", "-k", "2", "-n", "32", PROMPT)
    plain = mtp_run(root, "--draft", "none", "-n", "32", PROMPT)
    assert mtp["tokens"] == plain["tokens"]
    assert mtp["draft"] == "q:mtp"
    hist = mtp["stats"]["accept_hist"]
    assert len(hist) == 3 and all(hist), hist


# ------------------------------------------------------------------ serve


@pytest.fixture(scope="module")
def client(root, env):
    s = Server(env, "--target", str(root / "q"), "--draft", "mtp", "-k", "2", "-q",
               "--api-key", KEY)  # fmt: skip
    yield openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    code, err = s.stop()
    assert code == 0, err
    assert "Traceback" not in err, err


def test_serve_with_the_head_equals_no_draft(root, client):
    def complete(prompt=PROMPT, n=32, **body):
        return client.completions.create(
            model="q", prompt=prompt, max_tokens=n, temperature=0,
            extra_body={"return_tokens": True, **body},
        )  # fmt: skip

    # the editor case: a request whose prompt extends an earlier one's starts on its caches
    # (the target's and the head's), which a recurrent target can only extend, never trim
    complete(prompt=FIRST, n=1)
    got = complete()  # the server's default drafter: the head
    plain = complete(draft="none")
    assert plain.model_extra["specmlx"]["drafter"] == "none"
    assert plain.model_extra["specmlx"]["drafted"] == 0
    assert got.choices[0].text == plain.choices[0].text
    assert got.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    spec = got.model_extra["specmlx"]
    assert spec["drafter"] == "q:mtp" and spec["k"] == "2"
    assert spec["cached_tokens"] > 0  # it did start on the first request's caches
    assert spec["drafted"] > 0 and 0 < spec["accepted"] < spec["drafted"], spec
    assert got.usage.completion_tokens == 32
    # and cold, in one process, `specmlx run` says the same
    assert got.choices[0].text == mtp_run(root, "--draft", "none", "-n", "32", PROMPT)["text"]

    chunks = list(
        client.completions.create(
            model="q", prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_tokens": True},
        )
    )  # fmt: skip
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == plain.choices[0].text
    ids = [t for p in pieces for t in (p.model_extra.get("token_ids") or [])]
    assert ids == plain.choices[0].model_extra["token_ids"]
    from_draft = [f for p in pieces for f in (p.model_extra.get("token_from_draft") or [])]
    assert any(from_draft)  # tokens the head drafted reached the stream as kept drafts
    last = pieces[-1]
    assert last.finish_reason == "length"
    assert chunks[-2].model_extra["specmlx"]["drafted"] > 0
    assert chunks[-1].usage.completion_tokens == 32


# ------------------------------------------------------------------ bench


def test_bench_with_the_head(root, env, tmp_path):
    out = tmp_path / "bench.json"
    done = CliRunner().invoke(
        app,
        ["bench", "--target", str(root / "q"), "--draft", "mtp", "-n", "12", "--repeats", "1",
         "--limit", "2", "-k", "2,auto", "--temp", "0", "--json", str(out)],
        env=env,
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    result = json.loads(out.read_text())
    rows = {(r["system"], r["drafter"], r["k"]): r for r in result["rows"]}
    assert set(rows) == {
        ("target-only", "none", 0),
        ("mlx-lm", "none", 0),  # mlx-lm's plain loop still runs beside it
        ("specmlx", "q:mtp", 2),
        ("specmlx", "q:mtp", "auto"),
    }
    # one process, one machine: every greedy row is the target's, token for token
    assert all(r["same_as_target"] == "identical" for r in result["rows"]), result["rows"]
    # k = 2 drafts every round and keeps some; auto may draft little behind a head this weak
    assert rows[("specmlx", "q:mtp", 2)]["acceptance_rate"] > 0
    assert result["notes"] == [
        "no mlx-lm speculative rows: its loop cannot use a head over the target's hidden states"
    ]


# ------------------------------------------------------------------ two ranks


def test_two_ranks_with_the_head_equal_one_process(root, env):
    """The target split over two local ranks (mlx-lm's shard: the tiny config's 4 query /
    2 KV heads, 2 linear key / 4 value heads, 64 MLP units and 320 vocabulary rows all divide
    by 2), the head replicated on each. Greedy and a fixed k: the same tokens as one process,
    and the head drafted and kept the same tokens in every round, so it read the same hidden
    states (whole on each rank: the split layers sum their outputs) as in one process."""
    args = ["--draft", "mtp", "-k", "2", "-n", "32", PROMPT]
    one = mtp_run(root, *args)
    two = specmlx(env, "run", "--json", "-q", "--target", str(root / "q"), "--temp", "0",
                  *args[:-1], *TWO, PROMPT)  # fmt: skip
    assert tokens(two) == one["tokens"]
    got = json.loads(two.stdout)
    assert got["ranks"]["size"] == 2 and got["draft"] == "q:mtp"
    for key in ("drafted", "accepted", "accept_hist"):
        assert got["stats"][key] == one["stats"][key], key


# ------------------------------------------------------------------ every supported family


def _family_checkpoint(family: str, path: Path) -> None:
    """A tiny raw checkpoint of ``family`` with a random MTP head (kit_mtp's raw_checkpoint
    for the Qwen families, its raw_nextn_checkpoint for the model.layers.{N} ones)."""
    if family.startswith("qwen"):
        raw_checkpoint(path, family=family)
    elif family == "deepseek_v3":
        # two layers, the head's tensors in a file of their own, which mlx-lm's loader does
        # not read (model*.safetensors) and specmlx's does (every *.safetensors); a head in
        # the model's own file is left out of the target's load (test_mtp_dense.py)
        raw_nextn_checkpoint(path, deepseek_v3_config(2), fp8=True)
        w = mx.load(str(path / "model.safetensors"))
        mx.eval(list(w.values()))  # read it all before the file is written over
        head = {k: v for k, v in w.items() if k.startswith("model.layers.2.")}
        mx.save_safetensors(str(path / "model.safetensors"), {k: v for k, v in w.items()
                                                               if k not in head})  # fmt: skip
        mx.save_safetensors(str(path / "mtp.safetensors"), head)
    else:
        raw_nextn_checkpoint(path, glm4_moe_config(2), fp8=False)


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3", "glm4_moe"])
def test_every_family_through_run_serve_and_bench(family, tmp_path, root, env):
    """`--draft mtp` on a tiny checkpoint of each other supported family: `run`, a served
    completion and a bench row are the target's own greedy text (Qwen3.5 has the tests
    above)."""
    _family_checkpoint(family, tmp_path / "m")
    target = ["--target", str(tmp_path / "m")]
    run = lambda draft: local_json(root, *target, "--temp", "0", "--draft", draft, "-k",  # noqa: E731
                                   "2", "-n", "16", PROMPT)  # fmt: skip
    mtp, plain = run("mtp"), run("none")
    assert mtp["tokens"] == plain["tokens"] and mtp["stats"]["drafted"] > 0
    s = Server(env, *target, "--draft", "mtp", "-k", "2", "-q")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="-", max_retries=0, timeout=120)
        got = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == plain["text"]
        assert got.model_extra["specmlx"]["drafter"] == "m:mtp"
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err
    out = tmp_path / "bench.json"
    done = CliRunner().invoke(app, ["bench", *target, "--draft", "mtp", "-n", "8", "--repeats",
                                    "1", "--limit", "1", "-k", "2", "--temp", "0", "--json",
                                    str(out), "--compare", "none"], env=env)  # fmt: skip
    assert done.exit_code == 0, done.output
    rows = json.loads(out.read_text())["rows"]
    assert {r["drafter"] for r in rows} == {"none", "m:mtp"}
    assert all(r["same_as_target"] == "identical" for r in rows), rows


def test_bench_rows_of_the_head_beside_a_draft_models(root, env, tmp_path):
    """`bench --draft MODEL --mtp`: the head's rows and the draft model's in one table, each
    with its own step cost; every greedy row the target's."""
    make_tiny_model(tmp_path / "d", seed=1, vocab_size=336)  # the tiny tokenizer, more rows
    out = tmp_path / "bench.json"
    done = CliRunner().invoke(app, ["bench", "--target", str(root / "q"), "--draft",
                                    str(tmp_path / "d"), "--mtp", "-n", "8", "--repeats", "1",
                                    "--limit", "1", "-k", "2", "--temp", "0", "--compare",
                                    "none", "--json", str(out)], env=env)  # fmt: skip
    assert done.exit_code == 0, done.output
    result = json.loads(out.read_text())
    rows = {r["drafter"]: r for r in result["rows"]}
    assert set(rows) == {"none", "d", "q:mtp"}
    assert all(r["same_as_target"] == "identical" for r in result["rows"]), result["rows"]
    assert rows["q:mtp"]["draft_cost"] == result["head_cost"] > 0
    assert rows["d"]["draft_cost"] == result["draft_cost"] > 0
