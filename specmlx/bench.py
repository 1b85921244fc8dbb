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

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import mlx.core as mx

from .acceptance import DEFAULT_VERIFY, sampled_rule
from .adaptive import LOOKUP_MAX, PROBE_SIZES, AdaptiveK, curve_from, pass_times
from .caches import make_caches, mlx_lm_speculates
from .choosers import ChooserStore
from .distributed import World
from .errors import BadInput
from .lookup import LookupMemory
from .machine import blas_in_use, version
from .sampling import SamplingParams, make_processor, sample
from .session import Pair, Request, Session

# two logits this close (relative to the top one) count as tied: fp16 rounds at 2^-11 of a
# value, so this is about two of its units in the last place. Coarser dtypes get 2 eps of
# their own (bfloat16: 2^-7 relative each), since their rounding alone can flip such a pair.
NEAR_TIE_REL = 1e-3
MEMORY = " + memory"  # the drafter suffix of rows whose lookup also searches a lookup memory
STOP = " + stop"  # the drafter suffix of auto rows whose draft model stops per token


def theoretical_speedup(a: float, k: int, draft_cost: float) -> float:
    """Leviathan et al.'s expected speedup when verifying k tokens costs one target step:
    (1 - a^(k+1)) / ((1 - a)(k c + 1)), with a the acceptance rate and c = draft_cost, the
    time of a draft step over a target step."""
    tokens = float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
    return tokens / (k * draft_cost + 1.0)


def spread(values: list[float]) -> dict:
    """median, min and max of a list of measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@dataclass(frozen=True)
class System:
    """One configuration under test."""

    system: str  # "target-only", "specmlx", "mlx-lm"
    drafter: str  # "none", the draft alias, "lookup", "<draft> + lookup", "... + memory"
    k: int | str
    verify: str = DEFAULT_VERIFY  # specmlx's acceptance rule for sampled rounds

    @property
    def label(self) -> str:
        # rows of the default rule are labelled as before there was a choice
        rule = "" if self.verify == DEFAULT_VERIFY else f" verify={self.verify}"
        return f"{self.system} {self.drafter} k={self.k}{rule}"


@dataclass
class Run:
    """One generation: what came out and how long the decode part took."""

    label: str
    prompt: str
    temperature: float
    repeat: int
    tokens: list[int]
    decoded: int  # tokens after the first target pass
    decode_s: float
    drafted: int
    accepted: int
    same: str | None = None  # greedy: "identical", "near-tie" or "diverged" vs target-only


@dataclass
class BenchSettings:
    ks: list[int | str] = field(default_factory=lambda: [1, 2, 4, 8, "auto"])
    temps: list[float] = field(default_factory=lambda: [0.0, 0.8])
    top_p: float = 0.95
    max_tokens: int = 128
    repeats: int = 3
    compare_mlx_lm: bool = True
    lookup: bool = False  # add lookup and hybrid rows
    memory: bool = False  # with lookup: add rows that also look up in a lookup memory
    draft_stop: bool = False  # add auto rows whose draft model stops per token
    seed: int = 0
    verifies: list[str] = field(default_factory=lambda: [DEFAULT_VERIFY])  # rows per rule


def read_jsonl(path: str | None, builtin: str, what: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of the JSONL file ``path``, or of
    the packaged data/``builtin`` when path is None; ``what`` names it in errors."""
    try:
        text = (
            Path(path).read_text(encoding="utf-8")
            if path
            else resources.files("specmlx").joinpath(f"data/{builtin}").read_text(encoding="utf-8")
        )
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(
            f"cannot read {what} {path}: {e.strerror if isinstance(e, OSError) else e}"
        ) from None
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}:{i}: not JSON ({e.msg})") from None


def load_prompts(path: str | None, kind: str = "all") -> list[dict]:
    """The packaged code prompts, or any JSONL of {"prompt": ...}; ``kind`` filters by "kind".
    A row with "chat": true is an instruction, sent through the tokenizer's chat template."""
    rows = []
    for i, row in read_jsonl(path, "prompts.jsonl", "prompts"):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise BadInput(f'{path}:{i}: expected an object with a non-empty "prompt" string')
        row.setdefault("id", f"p{i}")
        if kind == "all" or row.get("kind", "code") == kind:
            rows.append(row)
    if not rows:
        raise BadInput(
            f"no prompts{'' if kind == 'all' else f' of kind {kind!r}'} in {path or 'the built-in set'}"
        )
    return rows


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
    chooser: AdaptiveK | None = None,
    world: World | None = None,
    memory: LookupMemory | None = None,
):
    """Generate once with one system; returns (tokens, decoded, decode_s, drafted, accepted).
    ``chooser`` is the system's adaptive-k state when k is "auto" (a fresh one if None);
    ``world``: the ranks the target is split over (k decided on rank 0, tokens compared);
    ``memory``: the lookup memory of a "+ memory" system (it remembers this output)."""
    params = _sampling(temp, s)
    if system.system == "mlx-lm":
        flags: list[bool] = []

        def events():
            d = draft if system.drafter != "none" else None
            for tok, fd in _mlx_lm_events(target, d, ids, system.k, params, s.max_tokens, seed):
                flags.append(fd)
                yield tok, fd

        tokens, decoded, secs = _timed(events())
        accepted = sum(flags)
        rounds = len(flags) - accepted  # every mlx-lm round ends with one target token
        return tokens, decoded, secs, rounds * int(system.k), accepted
    use_draft = system.drafter.split(" + ")[0] not in ("none", "lookup")
    request = Request(
        sampling=params,
        num_draft=(chooser or "auto") if system.k == "auto" else system.k,
        max_tokens=s.max_tokens,
        seed=seed,
        use_draft=use_draft and draft is not None,
        lookup="lookup" in system.drafter,
        verify=system.verify,
        draft_stop=system.drafter.endswith(STOP),
    )
    # no tokenizer: generations run to the budget, as mlx-lm's do (EOS is not theirs either)
    session = Session(
        Pair(target, draft, shared=shared),
        memory=memory if system.drafter.endswith(MEMORY) else None,
        world=world,
    )
    gen = session.start(ids, request)
    tokens, decoded, secs = _timed((e.token, e.from_draft) for e in gen.tokens())
    if gen.lockstep is not None:
        gen.lockstep.check()
    return tokens, decoded, secs, gen.stats.drafted, gen.stats.accepted


def systems(draft_name: str | None, s: BenchSettings) -> list[System]:
    """Every configuration to run, target-only first; specmlx rows once per verification rule
    in ``s.verifies``, side by side (k = 0 drafts nothing: one row, under the first rule)."""

    def rules(k: int | str) -> list[str]:
        return s.verifies if k != 0 else s.verifies[:1]

    def spec(drafter: str) -> list[System]:
        return [System("specmlx", drafter, k, v) for k in s.ks for v in rules(k)]

    out = [System("target-only", "none", 0)]
    if s.compare_mlx_lm:
        out.append(System("mlx-lm", "none", 0))  # mlx-lm's generate_step: our baseline's peer
    if draft_name:
        out += spec(draft_name)
        if s.draft_stop and "auto" in s.ks:  # per-token stopping needs the adaptive chooser
            out += [System("specmlx", draft_name + STOP, "auto", v) for v in rules("auto")]
        if s.compare_mlx_lm:
            out += [System("mlx-lm", draft_name, k) for k in s.ks if isinstance(k, int) and k > 0]
    if s.lookup:
        out += spec("lookup")
        if s.memory:
            out += spec("lookup" + MEMORY)
        if draft_name:
            out += spec(f"{draft_name} + lookup")
            if s.memory:
                out += spec(f"{draft_name} + lookup{MEMORY}")
    return out


def runs_at(system: System, temp: float, s: BenchSettings) -> bool:
    """Whether ``system`` runs at ``temp``: greedy decoding is the same under both rules, so
    block rows are sampled only, unless there is no token-wise row to stand for them."""
    block = system.system == "specmlx" and system.verify == "block"
    return not (block and temp == 0 and "token" in s.verifies)


def bench(
    target,
    draft,
    prompts: list[dict],
    encode: Callable[[dict], list[int]],
    s: BenchSettings,
    *,
    draft_name: str | None = None,
    shared: int | None = None,
    on_run: Callable[[Run], None] | None = None,
    world: World | None = None,
) -> dict:
    """Run every system on every prompt and temperature, interleaved, ``s.repeats`` times.

    target, draft: the loaded models (draft None: no draft rows); prompts: rows with "id"
    and "prompt"; encode: a prompt row -> token ids; s: what to sweep; draft_name: the
    draft's alias for the rows; shared: ids the draft may propose; on_run: called after each
    generation (progress); world: the ranks the target is split over (every rank runs this
    same sequence). A "+ memory" row's lookup memory starts empty in each repeat and
    remembers that repeat's outputs, prompt after prompt. Returns {"rows", "runs",
    "verify_curve", "draft_cost"}; the CLI adds the environment."""
    encoded = [(p["id"], encode(p)) for p in prompts]
    bed = _Testbed(target, draft, encoded[0][1], s, draft_name, shared, world)
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
    check_identity(runs, dict(encoded), target, bed.todo[0].label)
    return bed.result(runs)


def bench_sequences(
    target,
    draft,
    sequences: list[dict],
    encode: Callable[[dict], list[int]],
    decode: Callable[[list[int]], str],
    s: BenchSettings,
    *,
    draft_name: str | None = None,
    shared: int | None = None,
    on_run: Callable[[Run], None] | None = None,
    world: World | None = None,
) -> dict:
    """The editing sequences: each step asks for one more edit of the file the previous step
    wrote (every system follows its own outputs; greedy rows write the same ones). A
    "+ memory" row's lookup memory starts empty at each sequence and remembers its steps.

    sequences: rows from load_sequences; decode: token ids -> text (the next step's file);
    the rest as for ``bench``. Returns what ``bench`` returns; runs are named <id>-<step>."""
    first = edit_step(sequences[0], 0, sequences[0]["file"])
    bed = _Testbed(target, draft, encode(first), s, draft_name, shared, world)
    runs: list[Run] = []
    prompts: dict[str, list[int]] = {}
    for rep in range(s.repeats):
        for seq in sequences:
            memories = bed.memories()
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
    check_identity(runs, prompts, target, bed.todo[0].label)
    return bed.result(runs)


class _Testbed:
    """What every benchmark shares: the systems, the measured verify curve and draft cost,
    one adaptive-k state per auto system and temperature, and a warm-up."""

    def __init__(self, target, draft, ids, s: BenchSettings, draft_name, shared, world):
        for verify in s.verifies:
            sampled_rule(verify)
        self.target, self.draft, self.s, self.shared, self.world = target, draft, s, shared, world
        self.todo = systems(draft_name, s)
        self.notes: list[str] = []
        if not all(mlx_lm_speculates(m) for m in (target, draft) if m is not None):
            # mlx-lm's speculative loop raises on a cache it cannot trim (recurrent state)
            self.todo = [sy for sy in self.todo if sy.system != "mlx-lm" or sy.drafter == "none"]
            self.notes.append("no mlx-lm speculative rows: it refuses recurrent caches")
        ctx = ids + ids[: s.max_tokens // 2]
        t = pass_times(target, ctx, list(PROBE_SIZES), reps=5)
        self.curve = {n: t[n] / t[1] for n in t}
        self.cost = pass_times(draft, ctx, [1], reps=5)[1] / t[1] if draft is not None else None
        # one adaptive-k state per auto system and temperature, kept across its generations as
        # `specmlx run` keeps it on disk: what is measured is auto after its first few rounds.
        # They start from this measured curve and live in memory only.
        store = ChooserStore(persist=False, verify_ratio=curve_from(t, LOOKUP_MAX))
        self.choosers = {
            (sy, temp): store.get(target, "bench", sy.label, _sampling(temp, s), ids)
            for sy in self.todo
            if sy.k == "auto"
            for temp in s.temps
            if runs_at(sy, temp, s)
        }
        # warm-up: compile paths and fault in weights for every system once (auto: per
        # temperature); lookup memories are left empty
        warm = BenchSettings(**{**asdict(s), "max_tokens": 8})
        for system in self.todo:
            temps = [t for t in s.temps if runs_at(system, t, s)]
            for temp in temps if system.k == "auto" else temps[:1]:
                chooser = self.choosers.get((system, temp))
                run_one(system, target, draft, ids, temp, warm, s.seed, shared, chooser, world)

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
        tokens, decoded, secs, drafted, accepted = run_one(
            system,
            self.target,
            self.draft,
            ids,
            temp,
            self.s,
            self.s.seed + rep,
            self.shared,
            self.choosers.get((system, temp)),
            self.world,
            memory,
        )
        return Run(system.label, pid, temp, rep, tokens, decoded, secs, drafted, accepted)

    def result(self, runs: list[Run]) -> dict:
        return {
            "rows": summarize(runs, self.todo, self.s, self.cost),
            "runs": [asdict(r) for r in runs],
            "verify_curve": self.curve,
            "draft_cost": self.cost,
            "notes": self.notes,
        }


EDIT_ASK = (
    "Rewrite this code with {edit} (everything else unchanged). "
    "Reply with the complete rewritten code only.\n\n```{lang}\n{file}\n```"
)


def load_sequences(path: str | None = None) -> list[dict]:
    """Editing sequences: JSONL rows {"id", "lang", "file", "edits": [...]}; default: the
    built-in ones (data/edit_sequences.jsonl)."""
    rows = []
    for i, row in read_jsonl(path, "edit_sequences.jsonl", "edit sequences"):
        edits = row.get("edits") if isinstance(row, dict) else None
        if not isinstance(edits, list) or not edits or not isinstance(row.get("file"), str):
            raise BadInput(f'{path}:{i}: expected an object with "file" and a list of "edits"')
        row.setdefault("id", f"s{i}")
        row.setdefault("lang", "")
        rows.append(row)
    return rows


def edit_step(seq: dict, step: int, file: str) -> dict:
    """The prompt row (a chat instruction) for edit number ``step`` of ``seq`` on ``file``."""
    ask = EDIT_ASK.format(edit=seq["edits"][step], lang=seq["lang"], file=file.rstrip("\n"))
    return {"id": f"{seq['id']}-{step + 1}", "prompt": ask, "chat": True}


def code_of(text: str) -> str:
    """The code in a reply: its first fenced block (to the end when the fence is never
    closed), else the whole reply."""
    start = text.find("```")
    if start < 0:
        return text.strip("\n") + "\n"
    body = text[start + 3 :]
    body = body[body.find("\n") + 1 :] if "\n" in body else ""
    end = body.find("```")
    return (body if end < 0 else body[:end]).strip("\n") + "\n"


def _sampling(temp: float, s: BenchSettings) -> SamplingParams:
    return SamplingParams(temp, s.top_p if temp > 0 else 1.0)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length when one
    is a prefix of the other), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tie_tolerance(top: float, dtype: mx.Dtype) -> float:
    """How far below the top logit ``top`` a logit may be and still count as tied with it:
    NEAR_TIE_REL of its magnitude, or 2 eps of ``dtype`` (the logits' own) where coarser."""
    return max(NEAR_TIE_REL, 2 * mx.finfo(dtype).eps) * max(abs(top), 1.0)


def classify_difference(logits: mx.array, ref_token: int, token: int) -> str:
    """Where a greedy run first differs from target-only (which chose ``ref_token``, the run
    ``token``), given the target's logits (V,) at that position: "near-tie" when both tokens
    score within tie_tolerance of the best logit (so their gap, a top-2 gap, is below it:
    a kernel's rounding can flip it), else "diverged"."""
    top = float(logits.max().item())
    low = min(float(logits[ref_token].item()), float(logits[token].item()))
    return "near-tie" if top - low <= tie_tolerance(top, logits.dtype) else "diverged"


def target_logits_after(target, context: list[int], step: int = 512) -> mx.array:
    """The target's logits (V,) for the token after ``context``: a fresh cache prefilled in
    chunks, then one single-token pass, the shape target-only decoding used."""
    cache = make_caches(target)
    head = context[:-1]
    for i in range(0, len(head), step):
        target(mx.array(head[i : i + step], dtype=mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])
    return target(mx.array(context[-1:], dtype=mx.uint32)[None], cache=cache)[0, -1]


def identity(target, prompt: list[int], ref: list[int], tokens: list[int]) -> str:
    """ "identical", "near-tie" or "diverged": a greedy run's ``tokens`` against target-only's
    ``ref`` for the same ``prompt``; the target is run (once) only when they differ. A run that
    ends early or runs on past the reference cannot be judged by a tie: "diverged"."""
    at = first_difference(ref, tokens)
    if at is None:
        return "identical"
    if at >= min(len(ref), len(tokens)):
        return "diverged"
    logits = target_logits_after(target, prompt + ref[:at])
    return classify_difference(logits, ref[at], tokens[at])


def check_identity(runs: list[Run], prompts: dict[str, list[int]], target, base: str) -> None:
    """Set ``same`` on every greedy run: compared with the target-only run (label ``base``)
    of the same prompt and repeat. Sampled runs are left None."""
    ref = {(r.prompt, r.repeat): r.tokens for r in runs if r.label == base and r.temperature == 0}
    for r in runs:
        if r.temperature == 0 and (r.prompt, r.repeat) in ref:
            r.same = identity(target, prompts[r.prompt], ref[(r.prompt, r.repeat)], r.tokens)


SAME_ORDER = ("identical", "near-tie", "diverged")


def worst_same(runs: list[Run], ref: dict) -> str:
    """The worst verdict over a row's greedy runs; a run never checked counts as identical
    only when its tokens are."""
    verdicts = [
        r.same or ("identical" if r.tokens == ref[(r.prompt, r.repeat)] else "diverged")
        for r in runs
    ]
    return max(verdicts, key=SAME_ORDER.index, default="identical")


def summarize(
    runs: list[Run], todo: list[System], s: BenchSettings, draft_cost: float | None
) -> list[dict]:
    """One row per (system, temperature): medians over repeats of whole-prompt-set tok/s."""
    rows = []
    for temp in s.temps:
        base_label = todo[0].label  # target-only comes first
        base = _per_repeat(runs, base_label, temp, s.repeats)
        ref = {
            (r.prompt, r.repeat): r.tokens
            for r in runs
            if r.label == base_label and r.temperature == temp
        }
        for system in (sy for sy in todo if runs_at(sy, temp, s)):
            tps = _per_repeat(runs, system.label, temp, s.repeats)
            mine = [r for r in runs if r.label == system.label and r.temperature == temp]
            same = worst_same(mine, ref) if temp == 0 else None
            drafted = sum(r.drafted for r in mine)
            a = sum(r.accepted for r in mine) / drafted if drafted else 0.0
            k_mean = drafted / max(1, sum(_rounds(r) for r in mine)) if drafted else 0.0
            k_theory = system.k if isinstance(system.k, int) else k_mean
            cost = 0.0 if system.drafter.startswith("lookup") else (draft_cost or 0.0)
            theory = theoretical_speedup(a, k_theory, cost) if system.k != 0 else 1.0
            speedups = [x / b for x, b in zip(tps, base, strict=True)]
            speed = statistics.median(speedups)
            rows.append(
                {
                    "system": system.system,
                    "drafter": system.drafter,
                    "k": system.k,
                    "verify": system.verify if system.system == "specmlx" else None,
                    "temperature": temp,
                    **_named("tokens_per_sec", tps),
                    **_named("speedup", speedups),
                    "acceptance_rate": a,
                    "tokens_per_pass": sum(len(r.tokens) for r in mine)
                    / max(1, sum(_rounds(r) for r in mine)),
                    "draft_cost": cost,
                    "theoretical_speedup": theory,
                    "efficiency": speed / theory if theory else None,
                    "same_as_target": same,
                    "identical_to_target": None if same is None else same == "identical",
                    "decoded_tokens": sum(r.decoded for r in mine),
                }
            )
    return rows


def _named(name: str, values: list[float]) -> dict:
    """{name: median, name_min: min, name_max: max}."""
    s = spread(values)
    return {name: s["median"], f"{name}_min": s["min"], f"{name}_max": s["max"]}


def _rounds(r: Run) -> int:
    """Target passes of a run: one per round, each emitting accepted drafts plus one token."""
    return max(1, len(r.tokens) - r.accepted)


def _per_repeat(runs: list[Run], label: str, temp: float, repeats: int) -> list[float]:
    """Whole-prompt-set decode tok/s for each repeat."""
    out = []
    for rep in range(repeats):
        mine = [r for r in runs if r.label == label and r.temperature == temp and r.repeat == rep]
        out.append(sum(r.decoded for r in mine) / max(1e-9, sum(r.decode_s for r in mine)))
    return out


def git_revision() -> str | None:
    """The revision of the specmlx source that is running (None outside a git checkout),
    with "+dirty" when its tracked files differ from it. Read when a run starts: the tree
    may move on while a long benchmark runs, the imported code does not."""
    here = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=5)

    try:
        rev = git("rev-parse", "--short", "HEAD").stdout.strip()
        dirty = rev and git("diff", "--quiet", "HEAD", "--", ".").returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def environment(models: dict, rev: str | None = None) -> dict:
    """Versions, backend, BLAS, OS and chip, models, git revision (``rev``, from
    git_revision when the run started): what a figure depends on."""
    from . import __version__

    return {
        "specmlx": __version__,
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "device": str(mx.default_device()),
        "blas": blas_in_use(),
        "os": platform.platform(),
        "chip": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "models": models,
        "git": rev,
    }


def to_markdown(result: dict) -> str:
    """The rows as a Markdown table, plus the verify-cost curve and environment."""
    head = "| system | drafter | k | verify | temp | tok/s (min-max) | speedup | accept | tok/pass | theory | eff. | same as target |"
    lines = [head, "|" + "---|" * 12]
    shown = {"identical": "identical", "near-tie": "near-tie", "diverged": "**diverged**"}
    for r in result["rows"]:
        same = shown.get(r.get("same_as_target"), "n/a")
        eff = f"{r['efficiency']:.0%}" if r["efficiency"] else "-"
        lines.append(
            f"| {r['system']} | {r['drafter']} | {r['k']} | {r.get('verify') or '-'} | "
            f"{r['temperature']} | "
            f"{r['tokens_per_sec']:.2f} ({r['tokens_per_sec_min']:.2f}-{r['tokens_per_sec_max']:.2f}) | "
            f"{r['speedup']:.2f}x | {r['acceptance_rate']:.0%} | {r['tokens_per_pass']:.2f} | "
            f"{r['theoretical_speedup']:.2f}x | {eff} | {same} |"
        )
    curve = ", ".join(f"{n}: {v:.2f}" for n, v in result["verify_curve"].items())
    lines += ["", f"Verify cost (target pass over n tokens / 1 token): {curve}"]
    if result.get("draft_cost") is not None:
        lines.append(f"Draft/target step cost c = {result['draft_cost']:.3f}")
    lines.append(
        "Same as target (greedy rows): near-tie = the first difference is where the target's "
        f"two candidates score within {NEAR_TIE_REL:g} of the top logit (2 eps of the logits' "
        "dtype where coarser), which rounding can flip; only diverged is a failure"
    )
    env = result.get("environment", {})
    for role, m in (env.get("models") or {}).items():
        if m:
            lines.append(
                f"{role}: {m['alias']} ({m['dtype']}, {m['bytes'] / 1e9:.2f} GB) {m['label']}".rstrip()
            )
    if env:
        lines += [
            "",
            "Environment: " + "; ".join(f"{k}={v}" for k, v in env.items() if k != "models"),
        ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """tok/s and acceptance against k per system (needs matplotlib: pip install specmlx[plot])."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("--plot needs matplotlib: pip install 'specmlx[plot]'") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    groups: dict[tuple, list[dict]] = {}
    for r in result["rows"]:
        if isinstance(r["k"], int) and r["system"] != "target-only":
            groups.setdefault((r["system"], r["drafter"], r["temperature"]), []).append(r)
    for (system, drafter, temp), rs in groups.items():
        ks = [r["k"] for r in rs]
        name = f"{system} {drafter} T={temp}"
        ax1.plot(ks, [r["tokens_per_sec"] for r in rs], marker="o", label=name)
        ax2.plot(ks, [r["acceptance_rate"] for r in rs], marker="o", label=name)
    for r in result["rows"]:
        if r["system"] == "target-only":
            ax1.axhline(r["tokens_per_sec"], linestyle="--", color="gray")
    ax1.set(xlabel="k", ylabel="tok/s", title="decode speed")
    ax2.set(xlabel="k", ylabel="acceptance", title="acceptance rate")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
