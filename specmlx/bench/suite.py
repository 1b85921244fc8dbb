"""The side-by-side benchmark: target-only, specmlx at each k (token-wise and, when asked,
block verification), mlx-lm's own speculative loop.

Every system runs in one process on the same loaded models, prompts, sampler settings and
seeds, interleaved within each repeat so that a noisy machine's drift hits all of them alike.
mlx-lm gets specmlx's own sampler (temperature first, then the filters), so every row samples
the same target distribution.
Decode speed counts the tokens after a system's first target pass (prefill and the first
round excluded, the same rule for every system) over the wall time they took. Adaptive k
keeps its estimates from one generation to the next, as `specmlx run` does on disk, and its
warm-up feeds them: the rows measure auto once it has seen the pair, not its first rounds ever.

Greedy rows are checked against target-only: "identical", "near-tie" (the first difference is
where the target's two candidates score within a rounding tolerance, which another kernel
shape on a GPU can flip) or "diverged". The target's logits there are recomputed after the
runs, for the differing generations only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace

import mlx.core as mx

from ..core.acceptance import sampled_rule
from ..core.caches import mlx_lm_speculates
from ..core.sampling import SamplingParams, make_processor, sample
from ..core.stats import KChooser, count_depths
from ..decoding.session import DrafterChoice, Pair, Request, Session
from ..distributed.ranks import World
from ..drafting.choosing.adaptive import SUFFIX_MAX
from ..drafting.choosing.choosers import AUTO, ChooserStore, K, make_chooser
from ..drafting.choosing.cost_curve import PROBE_SIZES
from ..drafting.choosing.probe import curve_from, head_step_seconds, pass_times
from ..drafting.choosing.tree_size import OFF
from ..drafting.lookup.kinds import SUFFIX, LookupKind
from ..drafting.lookup.memory import LookupMemory
from .data import MEMORY, NGRAM, STOP, BenchSettings, Run, System, code_of, edit_step, runs_at
from .report import judge_greedy_runs, summarize


def _timed(events: Iterable[tuple[int, bool]]) -> tuple[list[int], int, float]:
    """Consume (token, from_draft) pairs; decode timing starts at the first target token.
    A generation with none (an immediate EOS, or a short budget filled by accepted drafts
    alone) has nothing to time: (tokens, 0, 0.0)."""
    tokens, mark, at = [], None, 0
    for tok, from_draft in events:
        tokens.append(tok)
        if mark is None and not from_draft:
            mark, at = time.perf_counter(), len(tokens)
    if mark is None:
        return tokens, 0, 0.0
    end = time.perf_counter()
    return tokens, len(tokens) - at, end - mark


def like_for_like_sampler(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    """A sampler for mlx-lm's generate_step and speculative_generate_step that samples what
    specmlx samples: mlx-lm's own applies top-p/min-p/top-k to the untempered distribution
    and the temperature at the draw, specmlx the temperature first (make_processor). It
    draws from MLX's global generator, as mlx-lm's samplers do.

    params: the sampling settings; greedy gives the argmax. The sampler takes log-probabilities
    (B, V) and returns token ids (B,)."""
    if params.greedy:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    process = make_processor(params)  # shift-invariant: log-probabilities are logits too
    return lambda logprobs: sample(process(logprobs), None)


def _mlx_lm_events(
    target, draft, ids, k, params: SamplingParams, max_tokens, seed
) -> Iterator[tuple[int, bool]]:
    from mlx_lm.generate import generate_step, speculative_generate_step

    mx.random.seed(seed)
    sampler = like_for_like_sampler(params)
    prompt = mx.array(ids, dtype=mx.uint32)
    if draft is None:
        for tok, _ in generate_step(prompt, target, max_tokens=max_tokens, sampler=sampler):
            yield int(tok), False
        return
    for tok, _, from_draft in speculative_generate_step(
        prompt, target, draft, num_draft_tokens=k, max_tokens=max_tokens, sampler=sampler
    ):
        yield int(tok), bool(from_draft)


def run_one(
    system: System,
    target,
    draft,
    ids,
    temp,
    s: BenchSettings,
    seed: int,
    shared: int | None,
    chooser: KChooser | None = None,
    world: World | None = None,
    memory: LookupMemory | None = None,
) -> Run:
    """Generate once with one system: its Run, whose prompt and repeat its caller names.
    ``chooser`` is the system's adaptive-k state when k is "auto", or a fixed k's FixedK
    holding the measured curve its auto trees read (None: a fresh one);
    ``world``: the ranks the target is split over (k decided on rank 0, tokens compared);
    ``memory``: the lookup memory of a "+ memory" system (it remembers this output)."""
    params = _sampling(temp, s)
    if system.system == "mlx-lm":
        flags: list[bool] = []

        def events():
            d = draft if system.drafter != "none" else None
            for tok, fd in _mlx_lm_events(
                target, d, ids, system.k.fixed, params, s.max_tokens, seed
            ):
                flags.append(fd)
                yield tok, fd

        tokens, decoded, secs = _timed(events())
        accepted = sum(flags)
        rounds = len(flags) - accepted  # every mlx-lm round ends with one target token
        tried, kept, run = [], [], 0
        for fd in flags:  # a round: its accepted drafts, then the target's own token
            if fd:
                run += 1
            else:
                count_depths(tried, kept, system.k.fixed, run)
                run = 0
        drafted = rounds * system.k.fixed
        return Run(system.label, "", temp, 0, tokens, decoded, secs, drafted, accepted,
                   depth_tried=tried, depth_accepted=kept)  # fmt: skip
    first = system.drafter.split(" + ")[0]
    use_draft = first != "none" and not first.startswith("look")  # (lookup, lookahead)
    request = Request(
        prompt_ids=ids,
        sampling=params,
        k=system.k,
        max_tokens=s.max_tokens,
        seed=seed,
        drafter=DrafterChoice(use_draft and draft is not None, _lookup_kind(system.drafter)),
        verify=system.verify,
        draft_stop=system.drafter.endswith(STOP),
        tree=system.tree,
    )
    # no tokenizer: generations run to the budget, as mlx-lm's do (EOS is not theirs either)
    session = Session(
        Pair(target, draft, shared=shared),
        memory=memory if system.drafter.endswith(MEMORY) else None,
        world=world,
    )
    gen = session.start(request, chooser=chooser)
    tokens, decoded, secs = _timed((e.token, e.from_draft) for e in gen.tokens())
    if gen.lockstep is not None:
        gen.lockstep.check()
    st = gen.stats
    return Run(system.label, "", temp, 0, tokens, decoded, secs, st.drafted, st.accepted,
               depth_tried=st.depth_tried, depth_accepted=st.depth_accepted,
               tree_rounds=st.tree_rounds, rank_tried=st.rank_tried,
               rank_kept=st.rank_kept)  # fmt: skip


def _lookup_kind(drafter: str) -> LookupKind | None:
    """How a row's lookup proposes, from its drafter's label ("lookup", NGRAM, a lookahead
    form, "DRAFT + lookup", each perhaps + MEMORY; None: no lookup)."""
    first = drafter.split(" + ")[0]
    if first.startswith("look"):  # lookup:ngram, lookahead[:...]
        return LookupKind.of(first)
    return SUFFIX if "lookup" in drafter else None


def systems(draft_name: str | None, s: BenchSettings, head_name: str | None = None) -> list[System]:
    """Every configuration to run, target-only first; specmlx rows once per verification rule
    in ``s.verifies``, side by side (k = 0 drafts nothing: one row, under the first rule);
    head_name: an MTP head's rows beside the draft's (specmlx only: mlx-lm cannot use one)."""

    def rules(k: K) -> list[str]:
        return s.verifies if k.fixed != 0 else s.verifies[:1]

    def spec(drafter: str, trees=(OFF,)) -> list[System]:
        return [System("specmlx", drafter, k, v, t) for k in s.ks for v in rules(k)
                for t in (trees if k.fixed != 0 else trees[:1])]  # fmt: skip

    out = [System("target-only", "none", K(0))]
    if s.compare_mlx_lm:
        out.append(System("mlx-lm", "none", K(0)))  # mlx-lm's generate_step: our baseline's peer
    if draft_name:
        out += spec(draft_name, s.trees)
        if s.draft_stop and AUTO in s.ks:  # per-token stopping needs the adaptive chooser
            out += [System("specmlx", draft_name + STOP, AUTO, v) for v in rules(AUTO)]
        if s.compare_mlx_lm:
            out += [System("mlx-lm", draft_name, k) for k in s.ks if not k.auto and k.fixed > 0]
    if s.lookup:  # suffix lookup (its trees where asked) beside n-gram lookup
        out += spec("lookup", s.trees) + spec(NGRAM)
        if s.memory:
            out += spec("lookup" + MEMORY, s.trees) + spec(NGRAM + MEMORY)
        if draft_name:
            out += spec(f"{draft_name} + lookup", s.trees)  # (with trees: siblings in one)
            if s.memory:
                out += spec(f"{draft_name} + lookup{MEMORY}")
    for ahead in s.lookaheads:  # (its own tree: no tree setting)
        out += spec(ahead)
    if head_name:
        out += spec(head_name, s.trees)
        if s.lookup:
            out += spec(f"{head_name} + lookup")
    return out


@dataclass(frozen=True)
class Benched:
    """The models a benchmark runs.

    target, draft: mlx-lm models (draft None: no draft rows); draft_name: the draft's alias
    for the rows; shared: ids the draft may propose; world: the ranks the target is split
    over (every rank runs the same sequence); head: (name, the target's MTP head) to bench
    beside the draft."""

    target: object
    draft: object | None = None
    draft_name: str | None = None
    shared: int | None = None
    world: World | None = None
    head: tuple[str, object] | None = None


def bench(
    models: Benched,
    prompts: list[dict],
    encode: Callable[[dict], list[int]],
    s: BenchSettings,
    *,
    on_run: Callable[[Run], None] | None = None,
) -> dict:
    """Run every system on every prompt and temperature, interleaved, ``s.repeats`` times.

    models: what runs; prompts: rows with "id" and "prompt"; encode: a prompt row -> token
    ids; s: what to sweep; on_run: called after each generation (progress). A "+ memory"
    row's lookup memory starts empty in each repeat and remembers that repeat's outputs,
    prompt after prompt. Returns {"rows", "runs",
    "pass_curve", "draft_cost"}; the CLI adds the environment."""
    encoded = [(p["id"], encode(p)) for p in prompts]
    bed = _Testbed(models, encoded[0][1], s)
    runs: list[Run] = []
    for rep in range(s.repeats):
        memories = bed.memories()
        for pid, ids in encoded:
            for temp in s.temps:
                for system in bed.systems_at(temp):
                    run = bed.run(system, ids, temp, rep, pid, memories.get((system, temp)))
                    runs.append(run)
                    if on_run:
                        on_run(run)
    judge_greedy_runs(runs, dict(encoded), models.target, bed.todo[0].label)
    return bed.result(runs)


def bench_sequences(
    models: Benched,
    sequences: list[dict],
    encode: Callable[[dict], list[int]],
    decode: Callable[[list[int]], str],
    s: BenchSettings,
    *,
    on_run: Callable[[Run], None] | None = None,
) -> dict:
    """The editing sequences: each step asks for one more edit of the file the previous step
    wrote (every system follows its own outputs; greedy rows write the same ones). A
    "+ memory" row's lookup memory starts empty at each repeat and remembers every step of
    every sequence (an agent's trace: later requests rewrite what earlier ones wrote).

    sequences: rows from load_sequences; decode: token ids -> text (the next step's file);
    the rest as for ``bench``. Returns what ``bench`` returns; runs are named <id>-<step>."""
    first = edit_step(sequences[0], 0, sequences[0]["file"])
    bed = _Testbed(models, encode(first), s)
    runs: list[Run] = []
    prompts: dict[str, list[int]] = {}
    for rep in range(s.repeats):
        memories = bed.memories()
        for seq in sequences:
            for temp in s.temps:
                files = {system: seq["file"] for system in bed.systems_at(temp)}
                for step in range(len(seq["edits"])):
                    for system in bed.systems_at(temp):
                        row = edit_step(seq, step, files[system])
                        ids = encode(row)
                        memory = memories.get((system, temp))
                        run = bed.run(system, ids, temp, rep, row["id"], memory)
                        if system == bed.todo[0]:
                            prompts.setdefault(row["id"], ids)
                        files[system] = code_of(decode(run.tokens))
                        runs.append(run)
                        if on_run:
                            on_run(run)
    judge_greedy_runs(runs, prompts, models.target, bed.todo[0].label)
    return bed.result(runs)


class _Testbed:
    """What every benchmark shares: the systems, the measured pass-cost curve and draft cost,
    one adaptive-k state per auto system and temperature, and a warm-up."""

    def __init__(self, models: Benched, ids: list[int], s: BenchSettings):
        for verify in s.verifies:
            sampled_rule(verify)
        target, draft, head = models.target, models.draft, models.head
        self.target, self.draft, self.s = target, draft, s
        self.shared, self.world = models.shared, models.world
        self.head = head  # (name, an MTP head) benched beside the draft, or None
        self.todo = systems(models.draft_name, s, head[0] if head else None)
        self.notes: list[str] = []
        if getattr(draft, "reads_hidden", None):  # mlx-lm's loop takes a model, not a head
            self.todo = [sy for sy in self.todo if sy.system != "mlx-lm" or sy.drafter == "none"]
            self.notes.append(
                "no mlx-lm speculative rows: its loop cannot use a head over the target's hidden states"
            )
        elif not all(mlx_lm_speculates(m) for m in (target, draft) if m is not None):
            # mlx-lm's speculative loop raises on a cache it cannot trim (recurrent state)
            self.todo = [sy for sy in self.todo if sy.system != "mlx-lm" or sy.drafter == "none"]
            self.notes.append("no mlx-lm speculative rows: it refuses recurrent caches")
        ctx = ids + ids[: s.max_tokens // 2]
        t = pass_times(target, ctx, list(PROBE_SIZES), reps=5)
        self.curve = {n: t[n] / t[1] for n in t}
        if getattr(draft, "reads_hidden", None):
            self.cost = head_step_seconds(draft, reps=5) / t[1]
        else:
            self.cost = pass_times(draft, ctx, [1], reps=5)[1] / t[1] if draft is not None else None
        self.head_cost = head_step_seconds(head[1], reps=5) / t[1] if head else None
        # one adaptive-k state per auto system and temperature, kept across its generations as
        # `specmlx run` keeps it on disk: what is measured is auto after its first few rounds.
        # They start from this measured curve and live in memory only.
        # A fixed k's greedy auto trees read the same curve (FixedK's cost), as `specmlx run`
        # reads a probe already run for them (not sampled ones, which read the guess there,
        # nor over ranks: each rank measured its own).
        ratio, ranked = curve_from(t, SUFFIX_MAX), self.world is not None and self.world.distributed
        store = ChooserStore(persist=False, pass_ratio=ratio)
        self.choosers = {
            (sy, temp): store.get(target, "bench", sy.label, _sampling(temp, s), ids)
            if sy.k.auto
            else make_chooser(sy.k, ratio if temp == 0 else None)
            for sy in self.todo
            if sy.k.auto or (sy.k.fixed and sy.tree.auto and not ranked)
            for temp in s.temps
            if runs_at(sy, temp, s)
        }
        # warm-up: compile paths and fault in weights for every system once (auto: per
        # temperature); lookup memories are left empty
        warm = replace(s, max_tokens=8)
        for system in self.todo:
            temps = [t for t in s.temps if runs_at(system, t, s)]
            for temp in temps if system.k.auto else temps[:1]:
                chooser = self.choosers.get((system, temp))
                d = self.draft_of(system)
                run_one(
                    system, target, d, ids, temp, warm, s.seed, self.shared, chooser, self.world
                )

    def draft_of(self, system: System):
        """The drafting model a system's rows use: the MTP head's rows the head, the rest
        the draft."""
        if self.head is not None and system.drafter.split(" + ")[0] == self.head[0]:
            return self.head[1]
        return self.draft

    def systems_at(self, temp: float) -> list[System]:
        return [sy for sy in self.todo if runs_at(sy, temp, self.s)]

    def memories(self) -> dict:
        """A fresh, empty in-memory lookup memory for each "+ memory" system and temperature."""
        return {
            (sy, temp): LookupMemory()
            for sy in self.todo
            if sy.drafter.endswith(MEMORY)
            for temp in self.s.temps
        }

    def run(self, system, ids, temp, rep, pid, memory) -> Run:
        made = run_one(
            system,
            self.target,
            self.draft_of(system),
            ids,
            temp,
            self.s,
            self.s.seed + rep,
            self.shared,
            self.choosers.get((system, temp)),
            self.world,
            memory,
        )
        return replace(made, prompt=pid, repeat=rep)

    def result(self, runs: list[Run]) -> dict:
        return {
            "rows": summarize(
                runs,
                self.todo,
                self.s,
                self.cost,
                (self.head[0], self.head_cost) if self.head else None,
            ),  # fmt: skip
            "runs": [asdict(r) for r in runs],
            "pass_curve": self.curve,
            "draft_cost": self.cost,
            "head_cost": self.head_cost,
            "notes": self.notes,
        }


def _sampling(temp: float, s: BenchSettings) -> SamplingParams:
    return SamplingParams(temp, s.top_p if temp > 0 else 1.0)
