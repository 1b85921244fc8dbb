"""Features together, not one by one (issue 63): a moved cache and a tree round each worked
alone and crashed together. Every pair of settings below runs in at least one case of a
covering array (``CASES``: all pairs in few runs), each case through the server's worker (its
prompt cache, its batch, its editor and chat prompts) over tiny random models:

- the prompt cache: a miss, a common-prefix hit, a moved run (--cache-reuse), the entries
  laid by warm-ups (llama.vim's n_predict 0) as an editor lays them;
- trees: off, auto, EAGLE-2's grown tree (expand:8);
- the drafter: a draft model, suffix lookup, n-gram lookup, a chained head (EAGLE-3 in its
  published layout) and self-drafting (an early exit);
- the rows: a lone request, one that joins a running row (batched), a lone one another
  joins (joined);
- greedy and seeded sampling;
- a full-attention target and a sliding-window one (prompts far longer than its window);
- an editor's FIM prompt (/infill's layout) and a chat.

Each case: no error; greedy text is the target's alone from the same caches (a fresh
worker, no draft, trees off, the same warm-ups); seeded text is the same request's on a
fresh worker with the same settings, alone (its draws do not depend on what runs beside
it). The grown tree is refused by name where it cannot grow (lookup, an early exit)."""

from __future__ import annotations

import itertools
import random
import threading
from dataclasses import dataclass

import numpy as np
import pytest
from families import family_config
from helpers import save_tiny, tiny_config, tiny_tokenizer
from kit_eagle3 import head_json, reference_head, save_head

from specmlx.core.kvstate import common_prefix
from specmlx.core.sampling import SamplingParams
from specmlx.decoding.fim import encode_infill, require_fim
from specmlx.decoding.session import DrafterChoice, Request
from specmlx.decoding.stream import chat_ids
from specmlx.drafting.choosing.choosers import AUTO as AUTO_K
from specmlx.drafting.choosing.choosers import K
from specmlx.drafting.choosing.tree_size import TreeSize
from specmlx.drafting.lookup.kinds import LookupKind
from specmlx.errors import BadInput
from specmlx.models.loading import load_pair
from specmlx.models.registry import load_registry
from specmlx.serving.worker import Worker

CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
FACTORS = {
    "model": ["full", "window"],
    "cache": ["miss", "prefix", "moved"],
    "tree": ["off", "auto", "expand:8"],
    "drafter": ["model", "suffix", "ngram", "eagle3", "self"],
    "rows": ["lone", "batched", "joined"],
    "sampling": ["greedy", "seeded"],
    "route": ["infill", "chat"],
}
GROWS = {"model", "eagle3"}  # the drafters a grown tree takes (the rest are refused by name)
REUSE = 16  # --cache-reuse: runs of at least this many tokens move
N = 10  # tokens each checked request makes


def _valid(case: dict) -> bool:
    return not (case.get("tree") == "expand:8" and case.get("drafter", "model") not in GROWS)


def covering(factors: dict, seed: int = 0) -> list[dict]:
    """Cases (a value per factor) that hold every valid pair of values of two factors at
    least once: greedy, each case the candidate (of a seeded sample) covering most pairs
    still missing."""
    names = list(factors)
    missing = {
        ((a, x), (b, y))
        for a, b in itertools.combinations(names, 2)
        for x in factors[a]
        for y in factors[b]
        if _valid({a: x, b: y})
    }
    rng, cases = random.Random(seed), []
    while missing:
        best, gain = None, -1
        for _ in range(400):
            case = {n: rng.choice(v) for n, v in factors.items()}
            if not _valid(case):
                continue
            got = sum(
                ((a, case[a]), (b, case[b])) in missing for a, b in itertools.combinations(names, 2)
            )
            if got > gain:
                best, gain = case, got
        cases.append(best)
        missing -= {((a, best[a]), (b, best[b])) for a, b in itertools.combinations(names, 2)}
    return cases


CASES = covering(FACTORS)


def test_the_cases_cover_every_pair():
    """The covering array holds every valid pair (and is checked, not trusted), in far
    fewer runs than the whole product."""
    names = list(FACTORS)
    for a, b in itertools.combinations(names, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            if _valid({a: x, b: y}):
                assert any(c[a] == x and c[b] == y for c in CASES), (a, x, b, y)
    assert all(_valid(c) for c in CASES) and len(CASES) <= 24, len(CASES)


# ------------------------------------------------------------------ the models


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> loaded (target, draft, shared) for every target x drafter the cases use: a
    tiny llama and a tiny Gemma 3 (window 8 on two layers of three) as targets, a tiny
    llama draft, an EAGLE-3 head for each target, an early exit; one tokenizer (FIM tokens,
    a chat template)."""
    root = tmp_path_factory.mktemp("combos")
    tok = tiny_tokenizer(fim=True)
    tok.chat_template = CHAT
    vocab = len(tok)
    save_tiny(root / "full", tiny_config(vocab, num_hidden_layers=4), tok, 0)
    save_tiny(root / "window", family_config("gemma3_text", 4, vocab), tok, 0)
    save_tiny(root / "draft", tiny_config(vocab), tok, 1)
    toml = root / "models.toml"
    toml.write_text(
        "".join(f'[models.{n}]\nsource = "local:{root / n}"\n' for n in ("full", "window", "draft"))
    )
    registry = load_registry([toml])
    loaded = {}
    for target in FACTORS["model"]:
        t, _, _ = load_pair(target, None, registry=registry, context=2048)
        hidden = t.model.args.hidden_size
        config = head_json(vocab, hidden=hidden, eagle_config={
            "eagle_aux_hidden_state_layer_ids": [0, 1, 2]})  # fmt: skip
        embed = np.array(t.model.model.embed_tokens.weight)
        head = save_head(root / f"eagle3-{target}", reference_head(config, 3, embed), config,
                         ship_embedding=False)  # fmt: skip
        drafts = {"model": "draft", "eagle3": f"eagle3:{head}", "self": "self:exit=1"}
        for name, draft in drafts.items():
            loaded[target, name] = load_pair(target, draft, registry=registry, context=2048)
        loaded[target, None] = (t, None, 0)
    return loaded, tok


# ------------------------------------------------------------------ prompts

LINES = [f"    value_{i} = compute({i}, scale) + offset\n" for i in range(80)]
EXTRA = [("util.py", "def add(a, b):\n    return a + b\n" * 3)]


def infill(tok, row: int, typed: str = "    val", after: int = 4) -> list[int]:
    """llama.vim's /infill prompt with the cursor in ``row``: the other file, 10 lines
    before, what was typed, ``after`` lines after."""
    template = require_fim(tok)
    prefix, suffix = "".join(LINES[row - 10 : row]), "".join(LINES[row : row + after])
    return encode_infill(tok, template, prefix, suffix, extra=EXTRA, middle=typed)


SYSTEM = {"role": "system", "content": "You write short Python helpers for a data team."}
TURNS = [
    ("How do I add two numbers a and b in Python, returning the sum?", "return a + b"),
    ("And how do I compute the value of each row with an offset and a scale?", "row * s + o"),
    ("Now write a class Point with x and y as integers, zero by default.", "class Point"),
    ("What does the quick brown fox jump over, and how many digits are there?", "the dog"),
]


def chat(tok, turns: list[int], asked: str) -> list[int]:
    """A chat prompt: the system message, the ``turns`` (indices of TURNS, each a question
    and its answer), then ``asked``."""
    messages = [SYSTEM]
    for i in turns:
        messages += [{"role": "user", "content": TURNS[i][0]},
                     {"role": "assistant", "content": TURNS[i][1]}]  # fmt: skip
    messages.append({"role": "user", "content": asked})
    return chat_ids(tok, messages)


def prompts(tok, route: str, cache: str) -> tuple[list[list[int]], list[int], list[int]]:
    """(the warm-ups laid first, the checked prompt, a neighbour's prompt) for a route and a
    prompt-cache state: a miss (nothing laid), a common prefix (the same start, another
    end), a moved run (an editor's window two lines further on; a chat whose oldest turn
    was dropped)."""
    if route == "infill":
        checked, neighbour = infill(tok, 40), infill(tok, 60, typed="    res")
        # moved: the window two lines up, its suffix reaching as far (the run to the
        # entry's end is llama.vim's follow-up, which crashed the next tree round)
        laid = {"miss": [], "prefix": [infill(tok, 40, after=2)],
                "moved": [infill(tok, 38, after=6)]}  # fmt: skip
    else:
        asked = "Write a function that returns the value with the offset."
        checked, neighbour = chat(tok, [1, 2], asked), chat(tok, [3], "Say hello.")
        laid = {"miss": [], "prefix": [chat(tok, [1, 2], "Say hi.")],
                "moved": [chat(tok, [0, 1, 2], asked)]}  # fmt: skip
    return laid[cache], checked, neighbour


# ------------------------------------------------------------------ through the worker


@dataclass
class Sent:
    """A request in a worker's hands: its tokens so far, its error, whether it ended."""

    tokens: list
    error: Exception | None = None
    started: threading.Event = None
    ended: threading.Event = None
    stats: object = None  # the job's Stats


def send(worker: Worker, request: Request) -> Sent:
    sent = Sent([], None, threading.Event(), threading.Event())

    def emit(kind, value):
        if kind == "piece":
            if value.token is not None:
                sent.tokens.append(value.token)
            sent.started.set()
        else:
            sent.error = value if kind == "error" else None
            sent.started.set()
            sent.ended.set()

    sent.stats = worker.submit(request, emit, editor=True).stats
    return sent


def wait(sent: Sent) -> list[int]:
    assert sent.ended.wait(120), "the request did not end"
    if sent.error is not None:
        raise sent.error
    return sent.tokens


def serve(loaded, case: dict, draft: str | None, alone: bool, tree: str) -> tuple[list[int], int]:
    """(the checked request's tokens, its cached prompt tokens) on a fresh worker over
    ``draft``'s pair (None: the target alone) after the case's warm-ups; with a neighbour
    unless ``alone``. tree: the case's setting, as text (parsed here, as the CLI would)."""
    models, tok = loaded
    tree = TreeSize.of(tree)
    name = {"suffix": "model", "ngram": "model"}.get(draft, draft)
    t, d, shared = models[case["model"], name]
    worker = Worker(t, d, shared, persist=False, lookup_memory=False, max_batch=4,
                    cache_budget=10**9, cache_reuse=REUSE if case["cache"] == "moved" else 0,
                    tree=tree)  # fmt: skip
    worker.start()
    try:
        laid, checked, other = prompts(tok, case["route"], case["cache"])
        for p in laid:
            wait(send(worker, Request(prompt_ids=p, warm_up=True, max_tokens=1)))
        seeded = case["sampling"] == "seeded"
        lookup = draft in ("suffix", "ngram")
        drafter = DrafterChoice(draft is not None and not lookup,
                                LookupKind(draft) if lookup else None)  # fmt: skip
        request = Request(
            prompt_ids=checked, max_tokens=N, tree=tree, drafter=drafter,
            sampling=SamplingParams(temperature=0.9 if seeded else 0.0), seed=7,
            k=K(3) if seeded else AUTO_K,
        )  # fmt: skip
        neighbour = Request(prompt_ids=other, max_tokens=3 * N, tree=tree, drafter=drafter,
                            seed=1)  # fmt: skip
        if alone or case["rows"] == "lone":
            checked = send(worker, request)
            return wait(checked), checked.stats.cached_tokens
        first, second = (neighbour, request) if case["rows"] == "batched" else (request, neighbour)
        a = send(worker, first)
        assert a.started.wait(120)
        b = send(worker, second)
        checked, other = (b, a) if case["rows"] == "batched" else (a, b)
        wait(other)
        return wait(checked), checked.stats.cached_tokens
    finally:
        worker.stop()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c.values()))
def test_features_together(models, case):
    got, cached = serve(models, case, case["drafter"], alone=False, tree=case["tree"])
    assert len(got) > 0
    if case["sampling"] == "greedy":  # the target's own text, from the same caches
        want, plain_cached = serve(models, case, None, alone=True, tree="off")
    else:  # the same draws alone, whatever ran beside it
        want, plain_cached = serve(models, case, case["drafter"], alone=True, tree=case["tree"])
    assert got == want, case
    laid, checked, _ = prompts(models[1], case["route"], case["cache"])
    if case["cache"] == "miss":  # (a neighbour running beside it may share its start)
        assert plain_cached == 0 and (cached == 0 or case["rows"] == "batched"), cached
    else:  # (a head gives one back: its last pair reads the next token, _head_keep)
        assert cached >= common_prefix(laid[0], checked[:-1]) - 1 > 0, cached
    # a moved run where the caches can move (a head is fed every position by a prefill)
    if case["cache"] == "moved" and case["drafter"] != "eagle3":
        assert cached == plain_cached > common_prefix(laid[0], checked) + REUSE, cached


@pytest.mark.parametrize("drafter", ["suffix", "ngram", "self"])
def test_a_grown_tree_is_refused_by_name_where_it_cannot_grow(models, drafter):
    case = dict(model="full", cache="miss", rows="lone", sampling="greedy", route="infill")
    with pytest.raises(BadInput, match="expand:8"):
        serve(models, case, drafter, alone=True, tree="expand:8")
