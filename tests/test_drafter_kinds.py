"""Every drafter kind through the same three tests: greedy decoding is the target's own, token
for token; sampled whole sequences follow the target's joint distribution (kit_distribution:
the chi-square over three-token sequences, with top-k, top-p and min-p on); and the same
chi-square rejects a rule that skips the residual, so each kind's test can fail.

The kinds: a draft model (both verification rules), prompt lookup, suffix lookup's tree,
lookahead decoding, lookup then a draft model (the chain), an MTP head, an EAGLE-3 head whose
vocabulary is narrower than the target's (q = 0 outside it), a DFlash block drafter, a draft
distilled by `specmlx distill`, the target drafting for itself (an early exit), a draft
model's rows in a batch that rows join and leave (both rules); token trees from the draft
model, an MTP head, an EAGLE-3 head, DFlash, Medusa, lookup beside a draft and over sliding
windows; and trees in a batch: each row its own tree in one pass (the draft model's, a
head's, a DFlash block's, over sliding windows). What only one kind has
(the reference code, loading, the CLI, ranks) stays in that kind's module (tests/README.md)."""

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from families import build, noisy_copy
from helpers import RowsTableLM, TableLM, distill_data, generate, make_tiny
from kit_distribution import (
    JOINT_PROMPT,
    JOINT_SAMPLING,
    JV,
    REJECT_P,
    engine_sequences,
    pooled_chi2,
    rejects,
    sequence_joint,
    skips_the_residual,
)
from kit_mtp import glm4_moe_config, random_head
from mlx.utils import tree_map, tree_map_with_path

from specmlx.core import tree_acceptance
from specmlx.core.acceptance import RULES, block_outcome, sampled_outcome
from specmlx.core.hidden import text_model
from specmlx.core.sampling import SamplingParams, make_processor
from specmlx.core.stats import Stats
from specmlx.decoding.batch import Batch
from specmlx.decoding.decode import Decode
from specmlx.distill.student import DistillConfig, make_student
from specmlx.distill.train import distill
from specmlx.drafting.choosing.choosers import K as KSetting
from specmlx.drafting.choosing.tree_size import OFF, TreeSize
from specmlx.drafting.heads import dflash, eagle3, medusa
from specmlx.drafting.self_draft import SelfDraft, SelfSpec
from specmlx.models.loading import Loaded
from specmlx.models.registry import ModelSpec


@dataclass(frozen=True)
class Pair:
    """A target and what drafts for it (None: lookup alone), the prompt its sequences
    follow, whether lookup proposes first, and whether it runs as a batch's rows."""

    target: nn.Module
    draft: nn.Module | None
    prompt: list[int]
    lookup: bool = False
    batched: bool = False
    tree: TreeSize = TreeSize()  # token trees (decoding.decode.Decode.tree)
    lookup_by: str = "suffix"  # how lookup proposes (decoding.decode.Decode.lookup_by)


def _noisy_tables(cls=TableLM) -> tuple[TableLM, TableLM]:
    """A table target and a draft with a noisy table: its first proposal is kept about two
    times in three."""
    target, draft = cls(JV, seed=20, scale=0.5), cls(JV, seed=20, scale=0.5)
    draft.table = target.table + 0.5 * mx.random.normal(target.table.shape, key=mx.random.key(7))
    mx.eval(target.table, draft.table)
    return target, draft


def _copying(target: TableLM) -> TableLM:
    """The target made to favour each id's successor (id + 1, about one time in two): after a
    prompt holding a run of consecutive ids, lookup proposes what the target often keeps."""
    successor = (mx.arange(JV)[:, None] + 1) % JV == mx.arange(JV)[None, :]  # (id, next id)
    target.table = target.table + 2.0 * successor[None]
    mx.eval(target.table)
    return target


def _randomized(head: nn.Module, seed: int) -> nn.Module:
    """Random weights as the reference tests give a head's: norms near one, the rest at 0.3."""
    mx.random.seed(seed)
    head.update(
        tree_map_with_path(
            lambda name, p: float(name.endswith("norm.weight")) + 0.3 * mx.random.normal(p.shape),
            head.parameters(),
        )
    )
    mx.eval(head.parameters())
    return head


def _draft_model(_tmp: Path) -> Pair:
    return Pair(*_noisy_tables(), JOINT_PROMPT)


def _lookup(_tmp: Path) -> Pair:
    # lookup proposes [4, 5] in round one; a new id (the residual's) leaves it nothing to offer
    return Pair(_copying(_noisy_tables()[0]), None, [3, 4, 5, 6, 3], lookup=True)


def _suffix_tree(_tmp: Path) -> Pair:
    """Suffix lookup's tree alone over a tiny llama (sharpened): the prompt's tail (3)
    occurred twice, followed by 2, 1, 0 (the target's greedy path) and by 5, 6, 3, so both
    continuations go in one tree of six nodes, siblings at the root (point masses)."""
    target = make_tiny(11, vocab=JV, layers=3, hidden=16, sharpen=2.0)
    return Pair(target, None, [3, 2, 1, 0, 3, 5, 6, 3], lookup=True, tree=TreeSize(6))


def _lookahead(tmp: Path) -> Pair:
    """Lookahead decoding over the "suffix-tree" pair: a window of two columns and two levels
    of Jacobi guesses beside suffix lookup's candidates, all point masses in one tree."""
    pair = _suffix_tree(tmp)
    return dataclasses.replace(pair, tree=TreeSize(), lookup_by="lookahead:w=2,n=3,g=2")


def _chain(_tmp: Path) -> Pair:
    # round one has no match (3 is new): the draft model drafts; lookup then offers what
    # followed 4 or 5 in the prompt
    target, draft = _noisy_tables()
    return Pair(_copying(target), draft, [4, 5, 3], lookup=True)


def _mtp(_tmp: Path) -> Pair:
    # the head reads the prompt's hidden states: it drafts in round one
    target = build("qwen3_5", 2, 0, vocab=JV)
    return Pair(target, random_head(target, "qwen3_5", scale=0.5), [3, 5, 1, 3])


def _eagle3(_tmp: Path) -> Pair:
    """A random EAGLE-3 head over a four-layer llama whose draft vocabulary lacks three of the
    target's ids (q = 0 there: only the residual can emit them)."""
    target = build("llama", 4, 0, vocab=JV)
    width = text_model(target).embed_tokens.weight.shape[1]
    config = eagle3.Eagle3Config(
        hidden=width, heads=4, kv_heads=2, head_dim=8, intermediate=64, eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_positions=2048, vocab=JV, draft_vocab=5,
        target_hidden=width, layers=(0, 1, 3),
    )  # fmt: skip
    head = _randomized(eagle3.Eagle3Head(target, config), seed=4)
    ids = np.array([0, 1, 3, 5, 6])  # the draft vocabulary's target ids
    head.map_vocabulary(mx.array(ids - np.arange(len(ids))))
    return Pair(target, head, [3, 5, 1, 3, 6])


def _dflash(_tmp: Path) -> Pair:
    """A random DFlash drafter (one layer, blocks of 4) over a four-layer qwen3."""
    target = build("qwen3", 4, 0, vocab=JV)
    config = dflash.DFlashConfig(
        hidden=text_model(target).embed_tokens.weight.shape[1], layers=1, heads=4, kv_heads=2,
        head_dim=8, bias=False, intermediate=64, eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_positions=512, vocab=JV, block_size=4, mask_id=JV - 1,
        target_layers=(1, 2),
    )  # fmt: skip
    return Pair(target, _randomized(dflash.DFlashHead(target, config), seed=4), [3, 5, 1, 3, 6])


class _IdTokenizer:
    """Token ids straight from bytes, for a teacher with a JV-token vocabulary."""

    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [b % JV for b in text.encode()]

    def save_pretrained(self, path: str) -> None:
        pass


def _distilled(tmp: Path) -> Pair:
    """A 4-block JV-token teacher and a 2-block student `specmlx distill` trained from it."""
    model = make_tiny(30, vocab=JV, layers=4, hidden=32, sharpen=2.0)
    config = {"model_type": "llama", "num_hidden_layers": 4, **model.args.__dict__}
    loaded = Loaded(model, _IdTokenizer(), ModelSpec("toy", "local", "/toy"), config, 0, 0, JV)
    cfg = DistillConfig(
        layers=2, steps=5, batch=4, seq_len=32, data_tokens=2048, heldout_tokens=128, lr=3e-3,
        warmup=2, eval_every=0, save_every=0, top_k=JV,
    )  # fmt: skip
    (tmp / "data").mkdir()
    events = list(distill(loaded, tmp / "student", cfg, distill_data(tmp / "data")))
    student, _, _ = make_student(loaded, cfg)
    student.load_weights(list(mx.load(str(tmp / "student" / "model.safetensors")).items()))
    evals = [e.metrics for e in events if e.phase == "eval"]
    assert evals[-1]["alpha"] > evals[0]["alpha"]  # it learned something
    return Pair(model, student, JOINT_PROMPT)


def _self_draft(_tmp: Path) -> Pair:
    """A tiny llama, its head sharpened, drafting from its first layer (then its head)."""
    target = make_tiny(11, vocab=JV, layers=3, hidden=16, sharpen=2.0)
    return Pair(target, SelfDraft(target, SelfSpec(exit=1)), JOINT_PROMPT)


def _tree(_tmp: Path) -> Pair:
    """A tiny llama and a draft that is its copy with a noisy head, its chain given side
    leaves (six nodes at most: the draft's next-best tokens as point masses beside its
    drawn ones)."""
    target = make_tiny(11, vocab=JV, layers=3, hidden=16)
    draft = make_tiny(11, vocab=JV, layers=3, hidden=16)
    noise = mx.random.normal(draft.lm_head.weight.shape, key=mx.random.key(3))
    draft.lm_head.weight = draft.lm_head.weight + 0.3 * noise
    mx.eval(draft.parameters())
    return Pair(target, draft, JOINT_PROMPT, tree=TreeSize(6))


def _medusa(_tmp: Path) -> Pair:
    """Random Medusa heads (three, one block each) over a tiny llama, drafting the first eight
    of Medusa's small tree: point masses at each head's top tokens."""
    target = make_tiny(11, vocab=JV, layers=3, hidden=16)
    heads = _randomized(medusa.MedusaHeads(16, JV, heads=3, layers=1), seed=8)  # (see kept)
    return Pair(
        target, medusa.MedusaDraft(heads), [3, 5, 1, 3], tree=TreeSize(8)
    )  # (hidden states to read)


def _siblings(tmp: Path) -> Pair:
    """The "tree" pair with lookup beside it: after a prompt that repeats, lookup's
    continuation (point masses) is a sibling branch of the draft's chain and side leaves."""
    return dataclasses.replace(_tree(tmp), prompt=[4, 5, 3, 4, 5, 3], lookup=True)  # (tree=6)


def _mtp_tree(_tmp: Path) -> Pair:
    """An MTP head's chain with side leaves, over a full-attention family (GLM-4 MoE's NextN
    layer: Qwen3.5's and Qwen3-Next's targets keep recurrent layers, which take no tree)."""
    module = importlib.import_module("mlx_lm.models.glm4_moe")
    mx.random.seed(0)
    target = module.Model(module.ModelArgs.from_dict({**glm4_moe_config(2), "vocab_size": JV}))
    # (the routers start at zero: random, so routing depends on the input)
    target.update(tree_map(lambda p: p if mx.any(p).item() else 0.3 * mx.random.normal(p.shape),
                           target.parameters()))  # fmt: skip
    mx.eval(target.parameters())
    return Pair(target, random_head(target, "glm4_moe", scale=0.5), [3, 5, 1, 3], tree=TreeSize(6))


def _eagle3_tree(tmp: Path) -> Pair:
    """The EAGLE-3 head's chain with side leaves (its next-best tokens at each chained step)."""
    return dataclasses.replace(_eagle3(tmp), tree=TreeSize(6))


def _dflash_tree(tmp: Path) -> Pair:
    """The DFlash block with side leaves (the next-best tokens at each block position)."""
    return dataclasses.replace(_dflash(tmp), tree=TreeSize(6))


def _dflash_ddtree(tmp: Path) -> Pair:
    """The DFlash block's tree with room for every leaf and its continuations (14 nodes at
    k = 2: the chain, four leaves a depth, a follower for each depth-1 leaf: the block's own
    token at depth 2, a point mass there)."""
    return dataclasses.replace(_dflash(tmp), tree=TreeSize(14))


def _window_tree(_tmp: Path) -> Pair:
    """A sliding-window target (gemma3_text, window 8) and its noisy copy, drafting over its
    own cursor (a window has no batch kind) with side leaves, after a prompt longer than the
    window: the tree pass masks each node to its own window."""
    target = build("gemma3_text", 3, 11, vocab=JV)
    draft = noisy_copy("gemma3_text", 3, 11, noise=0.6, vocab=JV)
    return Pair(target, draft, [3, 1, 4, 1, 5, 6, 2, 6, 5, 3], tree=TreeSize(6))


def _batch_rows(_tmp: Path) -> Pair:
    """The draft model's tables in models that read each row of a batch at its own length."""
    return Pair(*_noisy_tables(RowsTableLM), JOINT_PROMPT, batched=True)


def _batched(build: Callable[[Path], Pair]) -> Callable[[Path], Pair]:
    """A tree kind's pair decoded as a batch's rows, a tree each (core.tree_pass's rows)."""
    return lambda tmp: dataclasses.replace(build(tmp), batched=True)


@dataclass(frozen=True)
class Kind:
    """A drafter kind: how its pair is built, the generations its chi-square counts (``n``)
    and its wrong-rule control counts (``n_wrong``), and the least share of rounds that kept
    each of 0, 1 and 2 drafts (every accept path taken)."""

    build: Callable[[Path], Pair]
    n: int
    n_wrong: int
    kept: float


def _grown(build: Callable[[Path], Pair]) -> Callable[[Path], Pair]:
    """A kind's pair growing EAGLE-2's tree of 6 instead (``--tree expand:6``: every node a
    point mass, greedy or sampled, alone or in a batch)."""
    return lambda tmp: dataclasses.replace(build(tmp), tree=TreeSize(6, expand=True))


# n: 2.5x what the control needs (a deviation 2.5x subtler than skipping the residual still
# stands out as strongly at the test's own count); n_wrong: the control's cap, about 1.5x the
# count where it rejected with other seeds (kit_distribution.rejects stops there: most controls
# stop at half their cap). Measured at 1f7a71a, eight looks per control: draft-model 750 (both
# rules), lookup 50, lookup+draft 530, suffix-tree 300, lookahead 300, mtp 900, eagle3 450,
# dflash 500, distilled 440, self-draft 250, batch-rows 1750 (token) and > 2000 (block), tree
# 500, medusa 625, siblings 375, eagle3-tree 450, mtp-tree 600, dflash-tree 500,
# dflash-ddtree 600, window-tree 525, batch-tree 625, grown 700, eagle3-grown 225,
# batch-grown 700. The enumeration in test_acceptance.py carries the fine math.
KINDS = {
    "draft-model": Kind(_draft_model, 5_000, 1_500, 0.05),
    "lookup": Kind(_lookup, 2_000, 400, 0.05),
    "lookup+draft": Kind(_chain, 2_000, 900, 0.05),
    "suffix-tree": Kind(_suffix_tree, 2_000, 600, 0.03),
    "lookahead": Kind(_lookahead, 2_000, 600, 0.03),
    "mtp": Kind(_mtp, 3_000, 1_500, 0.02),
    "eagle3": Kind(_eagle3, 2_000, 800, 0.01),
    "dflash": Kind(_dflash, 2_000, 800, 0.01),
    "distilled": Kind(_distilled, 2_000, 700, 0.02),
    "self-draft": Kind(_self_draft, 1_500, 600, 0.03),
    "batch-rows": Kind(_batch_rows, 6_000, 3_500, 0.05),
    "tree": Kind(_tree, 2_500, 1_000, 0.03),
    "medusa": Kind(_medusa, 2_500, 1_000, 0.02),
    "siblings": Kind(_siblings, 2_000, 800, 0.02),
    "eagle3-tree": Kind(_eagle3_tree, 2_000, 800, 0.01),
    "mtp-tree": Kind(_mtp_tree, 3_000, 1_200, 0.02),
    "dflash-tree": Kind(_dflash_tree, 2_000, 800, 0.01),
    "dflash-ddtree": Kind(_dflash_ddtree, 2_000, 1_000, 0.01),
    "window-tree": Kind(_window_tree, 2_000, 900, 0.02),
    "batch-tree": Kind(_batched(_tree), 2_500, 1_000, 0.03),
    "batch-eagle3-tree": Kind(_batched(_eagle3_tree), 2_000, 600, 0.01),
    "batch-dflash-ddtree": Kind(_batched(_dflash_ddtree), 2_000, 800, 0.01),
    "batch-window-tree": Kind(_batched(_window_tree), 2_000, 600, 0.02),
    # a grown tree's nodes are point masses, each kept with the target's own probability:
    # rounds that keep 2 are rarer (1-2%) than a drawn chain's
    "grown": Kind(_grown(_tree), 2_000, 1_200, 0.005),
    "eagle3-grown": Kind(_grown(_eagle3), 2_000, 600, 0.005),
    "mtp-grown": Kind(_grown(_mtp_tree), 0, 0, 0.0),  # (greedy only: the head's is eagle3's)
    # a zero-first head (GLM's NextN) in a batch: rows of other lengths beside one at 0
    "batch-mtp-tree": Kind(_batched(_mtp_tree), 0, 0, 0.0),  # (greedy only: as mtp-tree's)
    "batch-grown": Kind(_batched(_grown(_tree)), 2_000, 1_200, 0.005),
}
# (kind, rule): both rules for the draft model and the batch, one for each other kind
RULED = [
    ("draft-model", "token"), ("draft-model", "block"), ("lookup", "block"),
    ("lookup+draft", "token"), ("mtp", "block"), ("eagle3", "block"), ("dflash", "token"),
    ("distilled", "block"), ("self-draft", "block"), ("batch-rows", "token"),
    ("batch-rows", "block"), ("tree", "token"), ("medusa", "token"),
    ("eagle3-tree", "token"), ("dflash-tree", "token"), ("siblings", "token"),
    ("suffix-tree", "token"), ("lookahead", "block"), ("window-tree", "token"),
    ("dflash-ddtree", "token"), ("batch-tree", "token"), ("mtp-tree", "token"),
    ("grown", "token"), ("eagle3-grown", "token"), ("batch-grown", "token"),
]  # fmt: skip
OUTCOMES = {"token": sampled_outcome, "block": block_outcome}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Callable[[str], Pair]:
    """Each kind's pair, built when a test first asks for it."""
    built: dict[str, Pair] = {}

    def pair(kind: str) -> Pair:
        if kind not in built:
            built[kind] = KINDS[kind].build(tmp_path_factory.mktemp(kind))
        return built[kind]

    return pair


# ------------------------------------------------------------------- batched rows

N_ROWS = 6  # rows decoded at once
NEIGHBOURS = [SamplingParams(), SamplingParams(0.7), SamplingParams(1.3, top_k=3)]


def batch_sequences(
    target, draft, verify: str, n: int, tree: TreeSize = OFF, first: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Counts of the three-token sequences of n rows sampled with JOINT_SAMPLING, each its
    own seed (apart from another call's with another ``first``), decoded in one Batch that rows join and leave as they finish (continuous
    admission): every fourth row to join is a neighbour with another sampler and budget (not
    counted), and k goes 2, 1, 3 round by round; tree: each row's token trees. Also how many
    rounds kept 0, 1, 2, 3 drafts."""
    batch, counts, kept = Batch(target, draft, JV, tree=tree), np.zeros(JV**3), np.zeros(4)
    joined = counted = rnd = 0
    counting = set()
    while counted < n:
        while len(batch.rows) < N_ROWS and joined - len(counting) <= 2 * n:
            if joined % 4 == 3:
                s, budget = NEIGHBOURS[joined % len(NEIGHBOURS)], 5
            else:
                s, budget = JOINT_SAMPLING, 3
            seed = (first << 20) + joined
            decode = Decode(s, KSetting(3), budget, seed=seed, verify=verify, tree=tree)
            row = batch.join(JOINT_PROMPT, decode)
            if s is JOINT_SAMPLING:
                counting.add(id(row))
            joined += 1
        batch.round((2, 1, 3)[rnd % 3])
        rnd += 1
        for row in [r for r in batch.rows if r.done]:
            batch.leave(row)
            if id(row) in counting and counted < n:
                a, b, c = row.ctx[len(JOINT_PROMPT) :]
                counts[(a * JV + b) * JV + c] += 1
                counted += 1
                kept[: len(row.stats.accept_hist)] += row.stats.accept_hist
            counting.discard(id(row))
    return counts, kept


def batch_greedy(pair: Pair, prompts: list[list[int]], k: int, n: int) -> list[list[int]]:
    """Greedy rows, one per prompt, joined together and decoded until each is done."""
    batch = Batch(pair.target, pair.draft, JV, tree=pair.tree)
    decode = Decode(SamplingParams(), KSetting(k), n, tree=pair.tree)
    rows = [batch.join(p, decode) for p in prompts]
    while batch.rows:
        batch.round(k)
        for row in [r for r in batch.rows if r.done]:
            batch.leave(row)
    assert sum(row.stats.drafted for row in rows) > 0
    if not pair.tree.off:  # every row verified trees, and some kept a side leaf (or drafts)
        assert all(row.stats.tree_rounds for row in rows), [r.stats for r in rows]
        grown = pair.tree.expand  # (no side leaves: EAGLE-2's trees)
        kept = [r.stats.accepted if grown else sum(r.stats.rank_kept) for r in rows]
        assert sum(kept) > 0, [r.stats for r in rows]
    return [row.ctx[len(p) :] for row, p in zip(rows, prompts, strict=True)]


# ------------------------------------------------------------------- the tests


def sequences(pair: Pair, verify: str, n: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    if pair.batched:
        return batch_sequences(pair.target, pair.draft, verify, n, pair.tree, first)
    return engine_sequences(
        pair.target, pair.draft, verify, n, prompt=pair.prompt, lookup=pair.lookup, tree=pair.tree,
        lookup_by=pair.lookup_by, first=first,
    )  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decoding_is_the_targets_own(pairs, kind):
    """Drafting at k = 3 (a DFlash block of 4 drafts at most 3) changes no token, and the
    drafter did draft; a batch's rows, of three prompt lengths, each equal their plain run."""
    pair = pairs(kind)
    prompts = [pair.prompt, [3, 5, 1, 3], [6, 2]] if pair.batched else [pair.prompt]
    plain = [[e.token for e in generate(pair.target, None, p, max_tokens=24)] for p in prompts]
    if pair.batched:
        assert batch_greedy(pair, prompts, 3, 24) == plain
        return
    stats = Stats()
    spec = generate(
        pair.target, pair.draft, pair.prompt, k=3, max_tokens=24, lookup=pair.lookup, stats=stats,
        tree=pair.tree, lookup_by=pair.lookup_by,
    )  # fmt: skip
    assert [e.token for e in spec] == plain[0]
    assert stats.drafted > 0
    if not pair.tree.off or kind == "lookahead":  # trees were verified and kept drafts
        assert stats.tree_rounds > 0 and stats.accepted > 0, stats
        grown = (
            "grown",
            "eagle3-grown",
            "mtp-grown",
            "batch-grown",
        )  # (no side leaves: EAGLE-2's trees)
        ranked = kind not in ("medusa", "siblings", "suffix-tree", "lookahead", *grown)
        assert sum(stats.rank_kept) > 0 or not ranked, stats


@pytest.mark.parametrize("kind,verify", RULED)
def test_sampled_sequences_follow_the_targets_joint(pairs, kind, verify):
    pair = pairs(kind)
    joint = sequence_joint(pair.target, make_processor(JOINT_SAMPLING), pair.prompt)
    counts, kept = sequences(pair, verify, KINDS[kind].n)
    assert pooled_chi2(counts, joint) > 1e-3
    assert all(kept[:3] > KINDS[kind].kept * kept.sum()), kept


@pytest.mark.parametrize("kind,verify", RULED)
def test_the_joint_test_rejects_a_rule_that_skips_the_residual(pairs, kind, verify, monkeypatch):
    pair = pairs(kind)
    joint = sequence_joint(pair.target, make_processor(JOINT_SAMPLING), pair.prompt)
    monkeypatch.setitem(RULES, verify, skips_the_residual(OUTCOMES[verify]))
    if not pair.tree.off or kind == "lookahead":  # a tree's rule: no residual between siblings
        monkeypatch.setattr(tree_acceptance, "_residual", lambda r, q: r)
    made = lambda n, first: sequences(pair, verify, n, first)[0]  # noqa: E731
    assert rejects(made, KINDS[kind].n_wrong, joint) < REJECT_P
