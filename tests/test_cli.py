"""The command line: output channels, --json, and every bad input giving one clear line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import DEMO_FACTS, make_tiny_model
from huggingface_hub import constants as hub_constants
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.drafting.choosing.adaptive import SUFFIX_MAX

runner = CliRunner()


@pytest.fixture
def registry(tmp_path, specmlx_home, monkeypatch):
    """A models.toml with tiny random models: a target, a draft, a draft with 16 extra ids,
    and a draft whose tokenizer differs. It is the default pair everywhere."""
    target = make_tiny_model(tmp_path / "t", seed=0)
    make_tiny_model(tmp_path / "d", seed=1)
    make_tiny_model(tmp_path / "d16", seed=2, extra_tokens=16)
    other = ["completely different text " * 5, "zebra quartz jam " * 9]
    make_tiny_model(tmp_path / "other", seed=3, corpus=other, vocab_size=None)
    (target.parent / "empty").mkdir()
    toml = tmp_path / "models.toml"
    toml.write_text(
        f"""
[defaults]
pair = "tiny"
pair_cpu = "tiny"
context = 512

[models.tiny-t]
source = "local:{tmp_path / "t"}"
[models.tiny-d]
source = "local:{tmp_path / "d"}"
[models.tiny-d16]
source = "local:{tmp_path / "d16"}"
[models.tiny-other]
source = "local:{tmp_path / "other"}"

[pairs.tiny]
target = "tiny-t"
draft = "tiny-d"
k = 3
"""
    )
    monkeypatch.setenv("SPECMLX_MODELS", str(toml))
    return tmp_path


CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def run(*args, input=None, env=None):
    return runner.invoke(app, list(args), input=input, env=env)


def one_line_error(result, code, *words):
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    # progress lines ("loading ...") may come first; the error is exactly one, the last line
    assert [ln for ln in lines if ln.startswith("error:")] == lines[-1:], lines
    err = lines[-1]
    for w in words:
        assert w.lower() in err.lower(), (w, err)


def test_run_streams_text_on_stdout_and_stats_on_stderr(registry):
    r = run("run", "def add(a, b):", "-n", "12")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip()
    assert "decode" in r.stderr and "tok/s" in r.stderr


def test_json_output_parses_and_adds_up(registry):
    r = run("run", "--json", "-n", "20", "-k", "2", "def add(a, b):")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object, nothing else
    keys = {"text", "tokens", "stats", "target", "draft", "k", "temperature", "seed", "verify"}
    assert set(out) == keys and out["verify"] == "block"  # the default rule
    s = out["stats"]
    assert s["accepted"] <= s["drafted"] and len(out["tokens"]) == s["generated"] <= 20
    assert out["draft"] == "tiny-d" and out["k"] == 2
    # each model's layer caches by kind (tiny llamas: full attention only)
    assert s["caches"] == {"target": {"KVCache": 2}, "draft": {"KVCache": 2}}
    assert s["replayed"] == 0


def test_json_says_what_auto_decided_and_from_what(registry):
    """-k auto's --json stats say where its state came from (a new chooser on a first run,
    the one saved on disk on the next), where its estimates stood, and the k of every round
    (k_hist adds up to the passes); a fixed k says nothing of auto."""
    first = json.loads(run("run", "--json", "-n", "24", "-k", "auto", "def add(a, b):").stdout)
    again = json.loads(run("run", "--json", "-n", "24", "-k", "auto", "def add(a, b):").stdout)
    fixed = json.loads(run("run", "--json", "-n", "24", "-k", "2", "def add(a, b):").stdout)
    assert first["stats"]["auto"]["from"].startswith("new: ")  # (a probe or a saved one)
    assert again["stats"]["auto"]["from"].startswith("saved")  # (+ a second probe, of 3)
    auto = again["stats"]["auto"]
    assert 0 < auto["a"] < 1 and auto["t_pass_s"] > 0 and auto["t_plain_s"] > 0, auto
    # (a tiny random pair: its drafts are rarely kept, so auto may have stopped drafting)
    assert auto["stopped"] in (True, False) and auto["drafting_rounds"] >= 0
    # the pass-cost shape it chose by: as probed on this machine, and as rounds corrected it
    cost = auto["pass_cost"]
    assert set(cost["probed"]) == set(cost["now"]) == {"2", "4", "8", "16"}, cost
    assert all(v > 0 for v in (*cost["probed"].values(), *cost["now"].values())), cost
    for out in (first, again, fixed):
        s = out["stats"]
        assert sum(s["k_hist"]) == s["rounds"]
        assert sum(k * n for k, n in enumerate(s["k_hist"])) == s["drafted"]
    assert fixed["stats"]["auto"] is None and sum(fixed["stats"]["k_hist"][1:]) > 0


def test_stdin_prompt_and_greedy_matches_target_only(registry):
    a = run("run", "-", "--json", "-n", "15", "--draft", "none", input="class Point:\n")
    b = run("run", "--json", "-n", "15", "-k", "4", "class Point:\n")
    c = run("run", "--json", "-n", "15", "--draft", "lookup", "class Point:\n")
    d = run("run", "--json", "-n", "15", "-k", "auto", "--draft-stop", "class Point:\n")
    ta, tb, tc, td = (json.loads(x.stdout)["tokens"] for x in (a, b, c, d))
    assert ta == tb == tc == td


def test_an_instruction_and_piped_text_both_reach_the_model(registry, tmp_path):
    """`cat file | specmlx run "INSTRUCTION"` (as `llm` and `ollama run` take it): the
    prompt is the instruction, a blank line, then the piped text; `-` alone is still stdin
    alone, a prompt with nothing piped is unchanged, and --chat wraps both in one user
    message, after --system's."""
    from specmlx.decoding.stream import chat_messages
    from specmlx.models.loading import load_model
    from specmlx.models.registry import load_registry

    tok = load_model(load_registry().resolve("tiny-t")).tokenizer
    code = "class Point:\n    x: int = 0\n"
    args = ("run", "--json", "-n", "4", "--draft", "none")
    both = json.loads(run(*args, "Explain this code.", input=code).stdout)
    assert both["stats"]["prompt_tokens"] == len(tok.encode(f"Explain this code.\n\n{code}"))
    alone = json.loads(run(*args, "-", input=code).stdout)
    assert alone["stats"]["prompt_tokens"] == len(tok.encode(code))
    bare = json.loads(run(*args, "Explain this code.").stdout)
    assert bare["stats"]["prompt_tokens"] == len(tok.encode("Explain this code."))
    tok.chat_template = CHAT_TEMPLATE
    (tmp_path / "t" / "tokenizer_config.json").write_text(
        json.dumps(json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
                   | {"chat_template": CHAT_TEMPLATE})
    )  # fmt: skip
    chat = run(*args, "--chat", "--system", "Be brief.", "Explain this code.", input=code)
    assert chat.exit_code == 0, chat.stderr
    messages = chat_messages(f"Explain this code.\n\n{code}", "Be brief.")
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert json.loads(chat.stdout)["stats"]["prompt_tokens"] == len(tok.encode(want))
    one_line_error(run(*args, "--system", "x", "hi"), 2, "--system is a chat's system message")


def test_lookup_memory_keeps_outputs_per_tokenizer(registry, specmlx_home):
    """With lookup, each run's output is kept under $SPECMLX_HOME/lookup/<tokenizer> and the
    next run looks it up (the same prompt again: its whole output is now a match, so fewer
    target passes); --no-lookup-memory neither reads nor writes; the text never changes."""
    args = ("run", "--json", "-n", "24", "-k", "6", "--draft", "lookup", "def add(a, b):")
    off = run(*args, "--no-lookup-memory")
    assert off.exit_code == 0, off.stderr
    assert not (specmlx_home / "lookup").exists()
    first, second = run(*args), run(*args)
    stores = list((specmlx_home / "lookup").iterdir())
    assert len(stores) == 1 and len(list(stores[0].glob("*.tok"))) == 2
    outs = [json.loads(r.stdout) for r in (off, first, second)]
    assert outs[0]["tokens"] == outs[1]["tokens"] == outs[2]["tokens"]
    assert outs[2]["stats"]["rounds"] < outs[1]["stats"]["rounds"]


def test_auto_k_resumes_from_the_last_run(registry, specmlx_home):
    """-k auto keeps what it learned per pair and sampler on disk; the next run starts there
    (a fresh chooser drafts 2 then measures a plain round; a resumed one does neither)."""
    base = run("run", "--json", "-n", "12", "--draft", "none", "def add(a, b):")
    first = run("run", "--json", "-n", "12", "-k", "auto", "def add(a, b):")
    assert first.exit_code == 0, first.stderr
    saved = list((specmlx_home / "adaptive").glob("*.json"))
    assert len(saved) == 1
    state = json.loads(saved[0].read_text())["state"]
    assert state["level"] > 0 and state["t_plain"] > 0
    assert len(state["verify_ratio"]) == SUFFIX_MAX + 1  # the probe: up to suffix lookup's pass
    second = run("run", "--json", "-n", "12", "-k", "auto", "def add(a, b):")
    assert json.loads(saved[0].read_text())["state"] != state  # it kept learning
    toks = [json.loads(r.stdout)["tokens"] for r in (base, first, second)]
    assert toks[0] == toks[1] == toks[2]  # lossless either way
    sampled = run("run", "--json", "-n", "4", "-k", "auto", "--temp", "0.7", "def add(a, b):")
    assert sampled.exit_code == 0, sampled.stderr
    assert len(list((specmlx_home / "adaptive").glob("*.json"))) == 2  # its own state


def test_block_verification_from_the_command_line(registry):
    args = ("run", "--json", "-n", "16", "-k", "3", "--temp", "0.8", "--seed", "3", "x = 1")
    a, b = run(*args, "--verify", "block"), run(*args, "--verify", "block")
    assert a.exit_code == 0, a.stderr
    out = json.loads(a.stdout)
    assert out["verify"] == "block" and len(out["tokens"]) == 16
    assert out["tokens"] == json.loads(b.stdout)["tokens"]  # seeded: reproducible
    greedy = [run("run", "--json", "-n", "16", "--verify", v, "x = 1") for v in ("token", "block")]
    assert json.loads(greedy[0].stdout)["tokens"] == json.loads(greedy[1].stdout)["tokens"]


def test_serve_refuses_an_unknown_verification_rule_before_loading(registry):
    one_line_error(run("serve", "--verify", "jointly"), 2, "verify")


def test_serve_on_a_busy_port_is_one_line_before_loading(registry, monkeypatch):
    """A busy port was found after the models loaded (and "listening on" was printed), as
    uvicorn's multi-line error and exit 3."""
    import socket

    from specmlx.models import loading

    loads = []
    monkeypatch.setattr(loading, "load_pair", lambda *a, **kw: loads.append(1))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        one_line_error(run("serve", "--port", str(port)), 2, "cannot listen", str(port))
    assert not loads  # refused before any loading


def test_vocab_superset_draft_is_accepted(registry):
    r = run("run", "--json", "-n", "10", "--draft", "tiny-d16", "x = 1")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["draft"] == "tiny-d16"


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and "specmlx" in r.stdout


@pytest.mark.parametrize(
    "args,code,words",
    [
        (["--target", "tiny-tt", "x"], 2, ["unknown model", "tiny-t"]),
        (["--target", "/nonexistent/model", "x"], 2, ["no such path"]),
        (["--draft", "tiny-other", "x"], 2, ["differs"]),  # shared ids mean other tokens
        (["--temp", "-1", "x"], 2, ["temperature"]),
        (["--temp", "nan", "x"], 2, ["temperature"]),
        (["--top-p", "1.5", "x"], 2, ["top-p"]),
        (["--top-p", "0", "x"], 2, ["top-p"]),
        (["-k", "-1", "x"], 2, ["-k"]),
        (["-k", "lots", "x"], 2, ["-k"]),
        (["--hosts", "127.0.0.1,127.0.0.1", "--draft-stop", "x"], 2, ["--draft-stop", "ranks"]),
        (["-n", "0", "x"], 2, ["max-tokens"]),
        (["   "], 2, ["empty"]),
        (["word " * 600], 2, ["context of 512", "tokens and --max-tokens asks for 256"]),
        (["-n", "500", "x" * 20], 2, ["asks for 500", "context of 512"]),
        (["--context", "0", "x"], 2, ["--context"]),
        (["--verify", "blocks", "x"], 2, ["verify", "token, block"]),
        (["-k", "3", "--draft-stop", "x"], 2, ["--draft-stop", "-k auto"]),
        (["--draft", "none", "--draft-stop", "x"], 2, ["--draft-stop", "draft model"]),
        (["--draft", "lookup:suffixes", "x"], 2, ["lookup:suffixes", "lookup:ngram", "lookahead"]),
        # a lookup option where nothing looks up would silently do nothing
        (["--draft", "none", "--lookup-memory", "x"], 2, ["--lookup-memory", "lookup:ngram"]),
        (["--no-lookup-memory", "x"], 2, ["--lookup-memory", "--lookup"]),
    ],
)
def test_bad_input_one_line(registry, args, code, words):
    one_line_error(run("run", *args), code, *words)


def test_directory_without_weights(registry):
    one_line_error(run("run", "--target", str(registry / "empty"), "x"), 1, "config.json")


def test_corrupt_safetensors(registry):
    (registry / "t" / "model.safetensors").write_bytes(b"\x00garbage")
    one_line_error(run("run", "x"), 1, "model.safetensors")


def test_model_too_big_for_memory(registry, monkeypatch):
    monkeypatch.setenv("SPECMLX_MEMORY_BUDGET", "1000")
    one_line_error(run("run", "x"), 1, "MB", "available")


def test_memory_is_planned_for_the_prompt_and_max_tokens(registry, monkeypatch):
    """The plan once ignored --max-tokens: it is for prompt + max tokens (within the context),
    so a budget that cannot hold the whole context can still hold a short run."""
    from specmlx.models import loading

    planned = []
    real = loading.plan_memory
    monkeypatch.setattr(
        loading, "plan_memory", lambda t, d, ctx, **kw: planned.append(ctx) or real(t, d, ctx, **kw)
    )
    assert run("run", "-n", "8", "--draft", "none", "x = 1").exit_code == 0
    assert run("run", "-n", "100", "--draft", "none", "x = 1").exit_code == 0
    # a token is at least a byte of text: the plan covers prompt bytes + max tokens, and
    # stays within the context (512) when that is more than a run can reach
    prompt = len(b"x = 1")
    assert prompt + 8 <= planned[0] < prompt + 100 <= planned[1] < 512


def test_non_utf8_stdin(registry):
    one_line_error(run("run", "-", input=b"\xff\xfe bad"), 2, "UTF-8")


def test_registry_errors(registry, tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text("[models.x]\nsource = \n")
    monkeypatch.setenv("SPECMLX_MODELS", str(bad))
    one_line_error(run("run", "x"), 2, "bad.toml:")
    bad.write_text('[models.x]\nsource = "local:/tmp"\ndtyp = "float16"\n')
    one_line_error(run("run", "x"), 2, "bad.toml:3", "dtyp")


def test_offline_model_not_in_cache(registry, tmp_path, monkeypatch):
    # huggingface_hub reads HF_HUB_OFFLINE and HF_HOME once, when it is imported (as a
    # user's shell sets them before specmlx starts): in this process, set what it read
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    one_line_error(
        run("run", "--target", "someone/not-cached-model", "--draft", "none", "x"), 1, "cache"
    )


def test_bench_json_schema(registry, tmp_path):
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "class Point:"}\n')
    r = run(
        "bench",
        "--prompts",
        str(prompts),
        "-k",
        "1,2,auto",
        "--temp",
        "0,0.8",
        "-n",
        "8",
        "--repeats",
        "1",
        "--lookup",
        "--json",
        str(out),
        "--markdown",
        str(md),
    )
    assert r.exit_code == 0, r.stderr
    result = json.loads(out.read_text())
    rows = result["rows"]
    need = {
        "system",
        "drafter",
        "k",
        "temperature",
        "tokens_per_sec",
        "speedup",
        "acceptance_rate",
        "tokens_per_pass",
        "draft_cost",
        "theoretical_speedup",
        "efficiency",
        "identical_to_target",
    }
    assert rows and all(need <= set(row) for row in rows)
    assert {row["system"] for row in rows} == {"target-only", "specmlx", "mlx-lm"}
    greedy = [row for row in rows if row["temperature"] == 0]
    assert all(row["identical_to_target"] for row in greedy)
    assert {"mlx", "mlx_lm", "blas", "device", "models", "git"} <= set(result["environment"])
    systems = {(r["system"], r["drafter"], r["k"], r["tree"]) for r in rows}
    assert len(result["runs"]) == 2 * 2 * len(systems)
    assert {r["tree"] for r in rows if r["drafter"] == "tiny-d" and r["system"] == "specmlx"} == {
        "off",
        "auto",
    }
    assert {"1", "2", "4", "8", "16"} <= set(result["pass_curve"])
    assert "| system |" in md.read_text()


def test_bench_compares_token_and_block_side_by_side(registry, tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    r = run(
        "bench", "--prompts", str(prompts), "-k", "2,auto", "--temp", "0,0.8", "-n", "8",
        "--repeats", "1", "--verify", "token,block", "--json", str(out), "--markdown", str(md),
        "--tree", "off",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    spec = [
        (row["k"], row["verify"], row["temperature"]) for row in rows if row["system"] == "specmlx"
    ]
    assert spec == [
        (2, "token", 0.0), ("auto", "token", 0.0),
        (2, "token", 0.8), (2, "block", 0.8), ("auto", "token", 0.8), ("auto", "block", 0.8),
    ]  # fmt: skip
    greedy = [row for row in rows if row["temperature"] == 0]
    assert all(row["same_as_target"] == "identical" for row in greedy)  # on CPU: exactly
    assert all(row["same_as_target"] is None for row in rows if row["temperature"] > 0)
    assert "| verify |" in md.read_text() and "identical" in md.read_text()
    # the table is the result (stdout), loading and progress are not (stderr)
    assert "specmlx bench (decode tok/s" in r.stdout and "verify" in r.stdout
    assert "identical" in r.stdout and "pass cost" in r.stdout
    assert "specmlx bench" not in r.stderr and "identical" not in r.stderr
    assert "loading tiny-t" in r.stderr and "loading" not in r.stdout


def test_bench_draft_stop_rows(registry, tmp_path):
    """--draft-stop adds an auto row whose draft stops per token, beside plain auto."""
    out, prompts = tmp_path / "bench.json", tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n')
    r = run(
        "bench", "--prompts", str(prompts), "-k", "2,auto", "--temp", "0", "-n", "12",
        "--repeats", "1", "--compare", "none", "--draft-stop", "--json", str(out), "--tree", "off",
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    rows = json.loads(out.read_text())["rows"]
    spec = [(row["drafter"], row["k"]) for row in rows if row["system"] == "specmlx"]
    assert spec == [("tiny-d", 2), ("tiny-d", "auto"), ("tiny-d + stop", "auto")]
    assert all(row["same_as_target"] == "identical" for row in rows)


@pytest.mark.parametrize(
    "args,words",
    [
        (["--verify", "token,blocks"], ["--verify", "token, block"]),
        (["--prompts", "/nonexistent.jsonl"], ["nonexistent"]),
        (["-k", "1,-2"], ["-k"]),
        (["--set", "poems"], ["--set"]),
    ],
)
def test_bench_bad_input(registry, args, words):
    one_line_error(run("bench", *args), 2, *words)


def test_bench_empty_prompt_file(registry, tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    one_line_error(run("bench", "--prompts", str(empty)), 2, "no prompts")


def _cli(*args):
    return [sys.executable, "-m", "specmlx", *args]


def test_closed_stdout_pipe_ends_quietly(registry):
    cmd = " ".join(_cli("run", "-n", "200", "--draft", "none", "-q", "def"))
    p = subprocess.run(
        f"{cmd} < /dev/null | head -c 5; exit ${{PIPESTATUS[0]}}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        env=dict(os.environ),
        timeout=300,
    )
    err = p.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err, err
    assert len(p.stdout) <= 5 and p.returncode == 0


def test_corrupt_and_unsupported_gguf(registry, tmp_path):
    from helpers import build_tiny_gguf, write_gguf

    path, _, meta, tensors = build_tiny_gguf(tmp_path)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:300])
    one_line_error(run("run", "--target", str(cut), "--draft", "none", "x"), 1, "corrupt")
    # a tensor of the wrong shape (Q5_K, which the gguf package dequantizes), an unknown type
    odd = dict(tensors, **{"blk.0.ffn_down.weight": ("Q5_K", (64, 256), b"\0" * 176 * 64)})
    q5k = write_gguf(tmp_path / "q5k.gguf", meta, odd)
    one_line_error(run("run", "--target", str(q5k), "--draft", "none", "x"), 1, "do not fit")
    odd = dict(tensors, **{"blk.0.ffn_down.weight": ("type 99", (64, 128), b"\0" * 64)})
    bad = write_gguf(tmp_path / "odd.gguf", meta, odd)
    one_line_error(run("run", "--target", str(bad), "--draft", "none", "x"), 1, "type 99")


def test_a_gguf_without_a_chat_template_takes_one_from_models_toml(registry, tmp_path):
    """--chat on a GGUF with no template is one line and exit 2; models.toml's chat_template
    (a Jinja file) serves it; a template that does not render is one line at load."""
    from helpers import build_tiny_gguf, write_gguf

    _, _, meta, tensors = build_tiny_gguf(tmp_path)
    meta = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    path = write_gguf(tmp_path / "bare.gguf", meta, tensors)
    good, bad = tmp_path / "chat.jinja", tmp_path / "bad.jinja"
    good.write_text(
        "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    bad.write_text("{{ messages[0]['content'] | no_such_filter }}")
    toml = registry / "models.toml"
    toml.write_text(
        toml.read_text()
        + f'[models.g]\nsource = "gguf:{path}"\n'
        + f'[models.g-chat]\nsource = "gguf:{path}"\nchat_template = "{good}"\n'
        + f'[models.g-bad]\nsource = "gguf:{path}"\nchat_template = "{bad}"\n'
    )
    one_line_error(run("run", "-t", "g", "-d", "none", "--chat", "hi"), 2, "no chat template")
    ok = run("run", "-t", "g-chat", "-d", "none", "--chat", "-n", "3", "--json", "hi")
    assert ok.exit_code == 0, ok.stderr
    assert json.loads(ok.stdout)["stats"]["prompt_tokens"] > 1
    one_line_error(run("run", "-t", "g-bad", "-d", "none", "x"), 1, "does not render", "bad.jinja")


@pytest.mark.parametrize(
    "draft,words",
    [
        ("lookup:fuzzy", ["lookup:fuzzy", "lookup (suffix)", "lookup:ngram", "lookahead"]),
        ("lookahead:w=99", ["lookahead", "w must be", "1 to 16"]),
        ("lookahead:q=2", ["lookahead", "unknown setting 'q'", "w=window"]),
    ],
)
def test_a_lookup_that_is_not_one_is_named_with_the_kinds(registry, draft, words):
    """--draft names a lookup kind that does not exist, or a lookahead setting that does not
    apply: one line naming what it got and what there is, exit 2, before anything loads;
    the kinds themselves run."""
    one_line_error(run("run", "--draft", draft, "x"), 2, *words)
    for kind in ("lookup:ngram", "lookahead:w=2,n=3,g=2"):
        ok = run("run", "--draft", kind, "-n", "3", "--json", "x y x y")
        assert ok.exit_code == 0, ok.stderr
        assert json.loads(ok.stdout)["stats"]["generated"] == 3


@pytest.mark.parametrize("prompt", ["-- top customers by revenue", "-1 + 2", "--\n-- a diff"])
def test_a_prompt_that_starts_with_a_dash(registry, prompt):
    """An SQL comment or a diff hunk is a prompt, not an option: the error says how to pass
    it, and `--` before it does."""
    one_line_error(run("run", prompt), 2, "starts with '-'", "specmlx run -- ")
    r = run("run", "-n", "3", "--draft", "none", "--", prompt)
    assert r.exit_code == 0, r.stderr
    typo = run("run", "--tmep", "0.5", "x")  # a mistyped option keeps click's message
    assert typo.exit_code == 2 and "No such option" in typo.stderr


def test_models_pull_fetches_without_loading(registry, monkeypatch):
    """Pull once loaded the whole model (68 GB for codellama-34b) just to download it."""
    from specmlx.models import loading

    def boom(*a, **kw):
        raise AssertionError("pull loaded weights")

    monkeypatch.setattr(loading, "load_model", boom)
    r = run("models", "pull", "tiny-t")
    assert r.exit_code == 0, r.stderr
    # what was pulled, and where, on stdout (path=$(...) works); nothing of it on stderr
    assert r.stdout.startswith("ready: tiny-t (") and str(registry / "t") in r.stdout
    assert "ready" not in r.stderr


def test_models_pull_plans_memory_before_quantizing(registry, tmp_path, monkeypatch):
    extra = tmp_path / "q.toml"
    extra.write_text(f'[models.tq]\nsource = "local:{registry / "t"}"\nquantize = {{ bits = 4 }}\n')
    monkeypatch.setenv("SPECMLX_MODELS", str(extra))
    monkeypatch.setenv("SPECMLX_MEMORY_BUDGET", "1kB")
    one_line_error(run("models", "pull", "tq"), 1, "available")
    monkeypatch.delenv("SPECMLX_MEMORY_BUDGET")
    r = run("models", "pull", "tq")
    assert r.exit_code == 0 and "GB quantized" in r.stdout, r.stderr
    assert "quantizing tq" in r.stderr and "quantized)" not in r.stderr  # progress apart
    assert list((registry / "specmlx-home" / "quantized").glob("tq-*/model.safetensors"))


def test_models_build_and_list(registry, monkeypatch):
    """`specmlx models build cpu-demo` works from a pip install (no scripts/ needed); the
    unbuilt pair's error names that command; `models list` sizes what it can and says "?"
    for what it cannot."""
    from specmlx.standins import cpu_demo as standin

    monkeypatch.setenv("SPECMLX_MODELS", str(registry / "models.toml"))
    one_line_error(
        run("run", "--target", "cpu-demo-target", "--draft", "none", "x"),
        1,
        "specmlx models build cpu-demo",
    )
    calls = []

    def fake_build(**kw):
        calls.append(kw)
        return json.loads(DEMO_FACTS) | {"built": True}

    monkeypatch.setattr(standin, "build_demo", fake_build)
    r = run("models", "build", "cpu-demo-target")
    assert r.exit_code == 0 and calls, r.stderr
    # the built pair's facts and "ready" are the result: stdout
    assert "ready: cpu-demo" in r.stdout and "check: max |dlogit|" in r.stdout
    assert "target: /x/target" in r.stdout and "ready" not in r.stderr and "check" not in r.stderr
    one_line_error(run("models", "build", "nonsense"), 2, "cpu-demo")
    odd = registry / "odd"
    odd.mkdir()
    (odd / "config.json").write_text('{"model_type": "mamba"}')
    extra = registry / "odd.toml"
    extra.write_text(f'[models.odd-model]\nsource = "local:{odd}"\n')
    monkeypatch.setenv("SPECMLX_MODELS", str(extra))
    r = run("models", "list")
    assert r.exit_code == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("│ odd-model "))
    assert "│ ?" in row and "│ yes" in row, row


def test_the_entry_point_re_execs_before_importing_mlx():
    """With OpenBLAS installed, `specmlx` re-execs itself with it preloaded; it once did so
    after importing mlx-lm and transformers, which then loaded twice (~1.2 s a call)."""
    code = """
import json, os, sys
import specmlx.entry as entry
entry.wants_openblas = lambda env: True
def fake_execve(exe, argv, env):
    heavy = [m for m in ("mlx.core", "mlx_lm", "transformers", "specmlx.cli") if m in sys.modules]
    print(json.dumps({"heavy": heavy, "argv": argv[1:], "preload": env["LD_PRELOAD"],
                      "again": env.get("SPECMLX_NO_OPENBLAS")}))
    sys.exit(0)
os.execve = fake_execve
sys.argv = ["specmlx", "--version"]
entry.main()
"""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["heavy"] == [] and got["argv"] == ["-m", "specmlx", "--version"]
    from specmlx.machine import OPENBLAS, wants_openblas

    assert got["preload"].startswith(OPENBLAS) and got["again"] == "1"
    assert not wants_openblas({"SPECMLX_NO_OPENBLAS": "1"})
    assert not wants_openblas({"LD_PRELOAD": OPENBLAS})


def test_bench_overhead_times_both_tools_on_the_same_tokens(specmlx_home, tmp_path):
    out = tmp_path / "o.json"
    result = run("bench", "--overhead", "-n", "12", "--repeats", "1", "--json", str(out))
    assert result.exit_code == 0, result.output
    # the table and the BLAS it ran on are the result: stdout
    assert "host overhead per token" in result.stdout and "BLAS: " in result.stdout
    assert "host overhead" not in result.stderr and "BLAS" not in result.stderr
    rows = json.loads(out.read_text())
    assert [r["k"] for r in rows] == [0, 2, 4]
    for r in rows:
        assert r["identical"], r  # the same greedy tokens from both tools
        assert r["specmlx_s"] > 0 and r["mlx_lm_s"] > 0
        assert r["ratio"] == pytest.approx(r["specmlx_s"] / r["mlx_lm_s"])  # one repeat
        assert r["best_ratio"] == pytest.approx(r["ratio"])  # one repeat: its own best
    one_line_error(run("bench", "--overhead", "-n", "1"), 2, "--overhead")


def test_models_list_sizes_a_cached_hub_model_without_the_network(registry, monkeypatch):
    """`models list` once asked the hub for the config and tensor headers of every cached
    hub model; now a cached one is sized from its files, and the network is never used."""
    import shutil

    import huggingface_hub
    from huggingface_hub import constants

    hub = registry / "hub"
    repo = hub / "models--org--tiny"
    shutil.copytree(registry / "t", repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))

    def network(*_a, **_kw):
        raise AssertionError("the network was used")

    for name in ("hf_hub_download", "get_safetensors_metadata"):
        monkeypatch.setattr(huggingface_hub, name, network)
    extra = registry / "hub.toml"
    extra.write_text('[models.hub-tiny]\nsource = "hf:org/tiny"\n')
    monkeypatch.setenv("SPECMLX_MODELS", str(extra))
    r = run("models", "list")
    assert r.exit_code == 0, r.stderr
    row = next(ln for ln in r.stdout.splitlines() if ln.startswith("│ hub-tiny "))
    assert "│ yes" in row and re.search(r"│ \d+\.\d\d GB", row), row


def test_models_list_is_on_stdout_a_whole_row_a_line(registry, monkeypatch):
    """`specmlx models list | grep NAME` finds the model's row: the listing is on stdout
    (it was on stderr), nothing of it on stderr, and in a pipe no row is wrapped or cut,
    however long its source or label (rich wrapped them at 160 columns)."""
    long_dir = registry / ("a-rather-long-directory-name-" * 4)
    long_dir.mkdir()
    label = "distilled: " + "a label far longer than any column rich would give it, " * 3
    extra = registry / "long.toml"
    extra.write_text(
        (registry / "models.toml").read_text()
        + f'[models.long-model]\nsource = "local:{long_dir}"\nlabel = "{label.strip()}"\n'
    )
    monkeypatch.setenv("SPECMLX_MODELS", str(extra))
    r = run("models", "list")
    assert r.exit_code == 0, r.stderr
    assert r.stderr == ""
    rows = [ln for ln in r.stdout.splitlines() if "long-model" in ln]  # what grep finds
    assert len(rows) == 1 and str(long_dir) in rows[0] and label.strip() in rows[0], rows
    assert "…" not in r.stdout  # no cell cut short
    tiny = [ln for ln in r.stdout.splitlines() if "tiny-t" in ln]
    assert tiny[0].startswith("│ tiny-t ") and tiny[-1] == "  tiny = tiny-t + tiny-d (k 3)"
    assert not any(ln.endswith(" ") for ln in r.stdout.splitlines())  # no padding in a pipe


def test_models_list_in_a_real_pipe(registry):
    """The same through a shell pipe, as a user runs it (`specmlx models list | grep`)."""
    cmd = " ".join(_cli("models", "list"))
    p = subprocess.run(f"{cmd} | grep tiny-d16", shell=True, capture_output=True, text=True,
                       env=dict(os.environ), timeout=120)  # fmt: skip
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert p.stdout.startswith("│ tiny-d16 ") and p.stdout.count("\n") == 1, p.stdout


def test_distill_reports_on_stdout_and_progress_on_stderr(registry, tmp_path):
    """`specmlx distill`: the finished run's facts, "ready" and how to run the draft on
    stdout; the progress (labelling, steps, held-out estimates) on stderr."""
    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 40)
    out = tmp_path / "stud"
    r = run("distill", "--target", "tiny-t", "--out", str(out), "--data", str(data),
            "--layers", "1", "--steps", "2", "--batch", "2", "--seq-len", "16",
            "--data-tokens", "64", "--heldout-tokens", "16", "--warmup", "0",
            "--eval-every", "1")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "held-out: greedy agreement" in r.stdout and "student: 1 of 2 blocks" in r.stdout
    assert f"ready: {out}" in r.stdout and "--draft stud" in r.stdout
    assert "step 1/2" in r.stderr and "loading tiny-t" in r.stderr
    assert "ready" not in r.stderr and "held-out:" not in r.stderr and "step 1/2" not in r.stdout


def test_help_lists_every_drafter_the_readme_lists():
    """`run --help`, `serve --help` and `chat --help` name every drafter form the README's
    `--draft` row names (medusa:PATH was missing from the help)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| `--target/-t`, `--draft/-d`"))
    forms = re.findall(r"`([a-z0-9]+(?::[A-Za-z=,]+)?)`", row.split("the draft may also be")[1])
    assert {"lookup", "medusa:PATH", "self:skip=LIST", "none"} <= set(forms), forms
    for command in ("run", "serve", "chat"):
        r = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
        shown = " ".join(re.sub(r"[│\s]+", " ", r.stdout).split())
        missing = [f for f in forms if f"'{f}'" not in shown]
        assert not missing, (command, missing)


def test_models_rm_removes_what_specmlx_stored_and_never_your_own_files(
    registry, specmlx_home, monkeypatch
):
    """`models rm ALIAS` (as `ollama rm`): a stand-in built under $SPECMLX_HOME and an alias's
    quantized copy go (with --yes; without it, and no terminal to ask on, a one-line error);
    an alias sharing its source with another keeps the source; a model at a path of the
    user's own, an alias not present and an unknown alias are one-line errors, exit 2.
    `models list` says what is present and its size."""
    from specmlx.models.quantized import quantized_dir
    from specmlx.models.registry import load_registry

    built = specmlx_home / "standins" / "built"
    make_tiny_model(built, seed=4)
    toml = registry / "models.toml"
    toml.write_text(
        toml.read_text()
        + f'[models.built]\nsource = "local:{built}"\n'
        + f'[models.built-q4]\nsource = "local:{built}"\nquantize = {{ bits = 4, group_size = 32 }}\n'
    )
    listed = run("models", "list")
    assert listed.exit_code == 0 and "present: 6 models, " in listed.stdout, listed.stdout
    q4 = quantized_dir(load_registry().models["built-q4"])
    q4.mkdir(parents=True)
    (q4 / "model.safetensors").write_bytes(b"0" * 1000)
    one_line_error(run("models", "rm", "built-q4"), 2, "add --yes")
    assert q4.exists()
    shared = run("models", "rm", "built-q4", "--yes")
    assert shared.exit_code == 0 and not q4.exists() and built.exists(), shared.stderr
    assert "kept the source files built also use" in shared.stdout
    one_line_error(run("models", "rm", "built-q4", "--yes"), 2, "nothing to remove", "built")
    one_line_error(run("models", "rm", "tiny-t", "--yes"), 2, "nothing to remove")
    one_line_error(run("models", "rm", "nope", "--yes"), 2, "no alias 'nope'")
    assert (registry / "t" / "config.json").exists()  # the user's own: never touched
    toml.write_text(toml.read_text().split("[models.built-q4]")[0])  # (the last alias of it)
    gone = run("models", "rm", "built", "-y")
    assert gone.exit_code == 0 and not built.exists(), gone.stderr
    assert gone.stdout.startswith("removed: built (0.")
