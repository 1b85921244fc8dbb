"""drafting/self_draft.py: the target drafts for itself (an early exit, layers skipped).
Greedy output equals the target's alone, for a lone request and a batch, over mlx-lm's
families; bad specs and families that cannot leave layers out are refused by name; the CLI
runs it. Its sampled whole sequences (the chi-square and its wrong-rule control) are
test_drafter_kinds.py's."""

import json
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import openai
import pytest
from families import build
from helpers import Server, generate, make_tiny, make_tiny_model
from kit_ranks import same_on_two_ranks
from kit_serve import server_env
from typer.testing import CliRunner

from specmlx.cli import app
from specmlx.core.kvstate import KVState
from specmlx.core.stats import Stats
from specmlx.decoding.batch import Batch
from specmlx.decoding.decode import Decode
from specmlx.drafting.choosing.choosers import K
from specmlx.drafting.self_draft import (
    SelfDraft,
    SelfSpec,
    choose_exit,
    layer_list,
    parse_self,
    shares_caches,
)
from specmlx.errors import BadInput, IncompatiblePair
from specmlx.models import loading
from specmlx.models.footprint import kv_bytes
from specmlx.models.loading import self_kv_bytes

PROMPT = list(range(3, 23))


@pytest.mark.parametrize(
    "name,words",
    [
        ("self:exit=0", "1 to 5"),
        ("self:exit=6", "1 to 5"),
        ("self:exit=x", "layer count"),
        ("self:skip=0-5", "every layer"),
        ("self:skip=7", "not 7"),
        ("self:skip=a", "not a layer"),
        ("self:deep=2", "self:exit=E"),
    ],
)
def test_bad_specs_are_refused_in_one_line(name, words):
    with pytest.raises(BadInput, match=words) as e:
        parse_self(name, 6)
    assert "\n" not in str(e.value)


def test_specs_parse():
    assert parse_self("self", 6).auto
    assert parse_self("self:exit=2", 6).run(6) == [0, 1]
    assert parse_self("self:skip=1,3-4", 6).run(6) == [0, 2, 5]
    assert parse_self("self:skip=4,1", 6).name() == "self:skip=1,4"


@pytest.mark.parametrize(
    "family", ["llama", "llama_swa", "gemma3_text", "exaone4", "qwen3_next", "mamba2"]
)
@pytest.mark.parametrize("name", ["self:exit=2", "self:skip=1"])
def test_greedy_output_is_the_targets_alone_and_in_a_batch(family, name):
    target = build(family, 4, 1, scale=3.0)
    plain = [e.token for e in generate(target, None, PROMPT, max_tokens=24)]
    draft = SelfDraft(target, parse_self(name, 4))
    stats = Stats()
    events = list(generate(target, draft, PROMPT, k=3, max_tokens=24, stats=stats))
    assert [e.token for e in events] == plain
    assert stats.drafted > 0  # it drafted (random layers: kept or not)
    batch = Batch(target, draft)
    row = batch.join(PROMPT, Decode(k=K(3), max_tokens=24))
    other = batch.join(PROMPT[5:], Decode(k=K(2), max_tokens=10))
    got = []
    while not row.done:
        got += [e.token for e in batch.round(3)[0]]
        if other.done and other in batch.rows:
            batch.leave(other)
    assert got == plain


def test_the_target_is_left_as_it_was():
    """The left-out layers are the target's own again after every call: nothing is
    patched, and the target alone computes what it did."""
    target = make_tiny(3, layers=4)
    layers = list(layer_list(target))
    x = mx.array([PROMPT])
    before = target(x)
    SelfDraft(target, SelfSpec(skip=(1, 2)))(x)
    assert all(a is b for a, b in zip(layer_list(target), layers, strict=True))
    assert mx.array_equal(target(x), before)
    # the draft owns no weights of its own: its parameters are the run layers' (by reference)
    draft = SelfDraft(target, SelfSpec(exit=1))
    assert draft.layers[0] is layers[0]


def test_an_exit_is_the_first_layers_then_the_head():
    """Exit at E: the target's own forward over its first E layers, then its norm and head
    (computed here by hand)."""
    target = make_tiny(4, layers=4)
    x = mx.array([PROMPT])
    inner = target.model
    h = inner.embed_tokens(x)
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(h, None)
    for layer in inner.layers[:2]:
        h = layer(h, mask, None)
    want = target.lm_head(inner.norm(h))
    got = SelfDraft(target, SelfSpec(exit=2))(x)
    assert mx.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "gemma3_text"])
@pytest.mark.parametrize("exit_", [1, 3])
def test_the_exit_shares_the_targets_caches(family, exit_):
    """A lone generation's exit drafts over the target's own caches (SharedExit): it keeps
    none of its own, and afterwards the target's caches hold what a plain generation's hold
    for the same tokens (within float32 tolerance: the verify pass is split at the exit).
    gemma3_text's sliding windows (8 wide here) slide many times over the 50 tokens."""
    target = build(family, 4, 1, scale=3.0)
    plain_kv, kv, stats = KVState(), KVState(), Stats()
    plain = [e.token for e in generate(target, None, PROMPT, max_tokens=30, kv=plain_kv)]
    draft = SelfDraft(target, SelfSpec(exit=exit_))
    assert shares_caches(draft)
    out = [e.token for e in generate(target, draft, PROMPT, k=3, max_tokens=30, kv=kv, stats=stats)]
    assert out == plain and stats.drafted > stats.accepted > 0  # (rollbacks happened)
    assert kv.draft is None and "draft" not in stats.caches  # nothing of its own
    assert kv.tokens == plain_kv.tokens
    for mine, theirs in zip(kv.target, plain_kv.target, strict=True):
        assert mine.offset == theirs.offset
        for a, b in zip(mine.state[:2], theirs.state[:2], strict=True):  # keys, values
            assert a.shape == b.shape and mx.allclose(a, b, atol=1e-4)
    # the next request from these caches (a prompt cache's) is the target's: the layers
    # below the exit hold what the exit wrote there, kept or given back with the rest
    again = [e.token for e in generate(target, draft, PROMPT + out[:5], k=3, max_tokens=12, kv=kv)]
    want = [e.token for e in generate(target, None, PROMPT + out[:5], max_tokens=12)]
    assert again == want
    # it moves into a batch (as a served request joined by another): there the exit keeps
    # caches of its own, caught up from nothing
    batch = Batch(target, draft)
    row = batch.join(PROMPT + out[:5], Decode(k=K(3), max_tokens=12), kv=kv)
    got = []
    while not row.done:
        got += [e.token for e in batch.round(3)[0]]
    assert got == want


def test_an_exit_over_recurrent_layers_keeps_its_own_caches():
    for family in ("qwen3_next", "mamba2"):
        target = build(family, 4, 1)
        assert not shares_caches(SelfDraft(target, SelfSpec(exit=2)))


@pytest.mark.parametrize("family", ["gemma4_text", "nemotron_h", "rwkv7"])
def test_families_that_cannot_leave_layers_out_are_refused_by_name(family):
    target = build(family, 4, 1)
    with pytest.raises(IncompatiblePair, match=family):
        SelfDraft(target, SelfSpec(exit=2))


def test_auto_picks_one_of_the_quarter_exits():
    target = make_tiny(5, layers=8, sharpen=3.0)
    spec = choose_exit(target, PROMPT * 3)
    assert spec.exit in (2, 4, 6)
    assert 0.0 <= spec.agreement <= 1.0 and spec == SelfSpec(exit=spec.exit)


def test_an_exit_measured_not_to_agree_never_drafts_and_stays_exact():
    """Auto's measured agreement reaches the chooser (choosers.for_drafter): an exit that
    agreed with the target on none of auto's passage drafts nothing in a short generation
    (a chooser told nothing drafts its first round), and the output is the target's."""
    target = make_tiny(5, layers=8)
    plain = [e.token for e in generate(target, None, PROMPT, k=0, max_tokens=24)]
    for agreement, drafts in ((0.0, False), (None, True)):
        draft, stats = SelfDraft(target, SelfSpec(exit=2, agreement=agreement)), Stats()
        out = generate(target, draft, PROMPT, k="auto", max_tokens=24, stats=stats)
        assert [e.token for e in out] == plain
        assert (stats.drafted > 0) == drafts, (agreement, stats.drafted)


# ------------------------------------------------------------------------------ the CLI


@pytest.fixture
def tiny_target(tmp_path, specmlx_home):
    return make_tiny_model(tmp_path / "t", seed=0, num_hidden_layers=4)


def test_run_drafts_from_the_targets_own_layers(tiny_target):
    runner = CliRunner()
    plain = runner.invoke(
        app, ["run", "--target", str(tiny_target), "--draft", "none", "-n", "24", "--json", "def f"]
    )
    out = runner.invoke(
        app,
        [
            "run",
            "--target",
            str(tiny_target),
            "--draft",
            "self:exit=2",
            "-k",
            "3",
            "-n",
            "24",
            "--json",
            "def f",
        ],
    )
    assert plain.exit_code == 0 and out.exit_code == 0, out.output
    a, b = json.loads(plain.stdout), json.loads(out.stdout)
    assert a["text"] == b["text"]
    assert b["stats"]["drafted"] > 0


def test_auto_keeps_its_choice(tiny_target, specmlx_home):
    runner = CliRunner()
    out = runner.invoke(
        app, ["run", "--target", str(tiny_target), "--draft", "self", "-n", "8", "def f"]
    )
    assert out.exit_code == 0, out.output
    path = specmlx_home / "self_exits.json"
    (entry,) = json.loads(path.read_text()).values()
    assert entry["exit"] in (1, 2, 3) and 0.0 <= entry["agreement"] <= 1.0, entry
    again = runner.invoke(
        app, ["run", "--target", str(tiny_target), "--draft", "self", "-n", "8", "def f"]
    )
    assert again.exit_code == 0 and "choosing" not in again.stderr, again.output
    # an older file's bare exit number is measured again, and kept in today's form
    path.write_text(json.dumps({key: entry["exit"] for key in json.loads(path.read_text())}))
    old = runner.invoke(
        app, ["run", "--target", str(tiny_target), "--draft", "self", "-n", "8", "def f"]
    )
    assert old.exit_code == 0 and "choosing" in old.stderr, old.output
    assert list(json.loads(path.read_text()).values()) == [entry]


@pytest.mark.parametrize(
    "name,words", [("self:exit=4", "1 to 3"), ("self:skip=0-3", "every layer")]
)
def test_run_refuses_a_bad_spec_in_one_line(tiny_target, name, words):
    out = CliRunner().invoke(app, ["run", "--target", str(tiny_target), "--draft", name, "x"])
    assert out.exit_code == 2, out.output
    lines = out.stderr.strip().splitlines()
    assert lines == [ln for ln in lines if ln.startswith("error:")] and words in lines[0], lines


LLAMA8 = {"model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64,
          "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def test_the_memory_plan_counts_only_the_kv_the_draft_keeps_of_its_own():
    """An exit drafting over the target's own caches (a lone generation, attention below the
    exit) adds no KV cache; a server's exit, a skip list and an exit over a recurrent layer
    keep their layers' own, and auto plans for its deepest exit."""
    full = kv_bytes(LLAMA8, 1000, 2)
    plan = lambda name, lone, config=LLAMA8: self_kv_bytes(config, name, 1000, 2, lone)  # noqa: E731
    assert plan("self:exit=2", True) == plan("self", True) == 0
    assert plan("self:exit=2", False) == full * 2 // 8
    assert plan("self", False) == int(full * 0.75)
    assert plan("self:skip=1,2", True) == plan("self:skip=1,2", False) == full * 6 // 8
    hybrid = LLAMA8 | {"hybrid_override_pattern": "*M******"}  # a recurrent layer 1
    assert plan("self:exit=1", True, hybrid) == 0  # (the layer below it keeps attention)
    assert plan("self:exit=2", True, hybrid) == int(kv_bytes(hybrid, 1000, 2) * 2 / 8) > 0
    with pytest.raises(BadInput, match="1 to 7"):
        plan("self:exit=8", True)


@pytest.mark.parametrize("stop", [False, True])
def test_run_and_bench_plan_an_exit_as_lone_unless_it_stops_per_token(tiny_target, monkeypatch,
                                                                      stop):  # fmt: skip
    """`run` and `bench` generate alone: the exit shares the target's caches, unless
    per-token stopping drafts over the exit's own."""
    seen = []

    def refuse(*args, **kw):
        seen.append(kw.get("lone"))
        raise BadInput("planned")

    monkeypatch.setattr(loading, "load_pair", refuse)
    more = ["--draft-stop", "-k", "auto"] if stop else []
    for cmd in (["run", "x"], ["bench", "-n", "4"]):
        out = CliRunner().invoke(
            app, [*cmd, "--target", str(tiny_target), "--draft", "self:exit=1", *more]
        )
        assert out.exit_code == 2 and "planned" in out.stderr, out.output
    assert seen == [not stop, not stop]


def test_a_pair_names_self_drafting(tiny_target, tmp_path, monkeypatch):
    """models.toml may name self-drafting as a pair's draft (as codellama-layerskip does):
    --target then drafts from the target's own layers."""
    toml = tmp_path / "models.toml"
    toml.write_text(
        f'[models.tiny-ls]\nsource = "local:{tiny_target}"\n'
        '[pairs.tiny-ls]\ntarget = "tiny-ls"\ndraft = "self:exit=1"\nk = 2\n'
    )
    monkeypatch.setenv("SPECMLX_MODELS", str(toml))
    out = CliRunner().invoke(app, ["run", "--target", "tiny-ls", "-n", "12", "--json", "def f"])
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert got["draft"].endswith("self:exit=1") and got["stats"]["drafted"] > 0


def test_serve_drafts_from_the_targets_own_layers(tiny_target, tmp_path):
    """The official openai client against `specmlx serve --draft self:exit=2`: a lone
    request (the exit over the target's caches) and requests sent together (rows of the
    server's batch where they overlap; the batch itself is tested above) each give the text
    the target alone gives."""
    (tmp_path / "models.toml").write_text("")
    env = server_env(tmp_path, tmp_path / "models.toml")
    s = Server(env, "--target", str(tiny_target), "--draft", "self:exit=2", "-k", "3", "-q")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)

        def complete(prompt, **body):
            got = client.completions.create(model="t", prompt=prompt, max_tokens=20,
                                            temperature=0, extra_body=body)  # fmt: skip
            return got.choices[0].text, got.model_extra["specmlx"]

        prompts = ["def add(a, b):\n", "class Point:\n", "import os\n"]
        plain = [complete(p, draft="none")[0] for p in prompts]
        alone, spec = complete(prompts[0])
        assert alone == plain[0] and spec["drafted"] > 0, spec
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda p: complete(p)[0], prompts))
        assert together == plain
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err


def test_the_exit_runs_over_two_ranks(tiny_target, tmp_path):
    """The target split over two local ranks: the exit's layers are the target's shards,
    and every rank drafts, verifies and keeps alike (the same tokens and rounds as one
    process)."""
    got = same_on_two_ranks(tmp_path, tiny_target, "self:exit=2", 3)
    assert got["stats"]["drafted"] > 0
