"""The one place that turns a k setting into a chooser, and the store of adaptive choosers.

A k setting is parsed once into a ``K`` (a fixed count, or adaptive). For adaptive k,
``ChooserStore`` keeps one AdaptiveK per target, drafter, sampler and machine: in memory for a
long-lived process (the server, the bench) and on disk under $SPECMLX_HOME/adaptive across
runs, so each run starts from what the last one learned. Both files it writes (the chooser
state and the target's probed pass-cost curve) are best effort: a read-only home costs one
warning line and the run goes on.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...core.acceptance import DEFAULT_VERIFY
from ...core.sampling import SamplingParams
from ...core.stats import KChooser, RoundReport
from ...errors import BadInput
from ...machine import machine_id
from ...paths import Warn, load_json, save_json, specmlx_home
from .adaptive import SUFFIX_MAX, AdaptiveK
from .cost_curve import CostCurve
from .probe import curve_from, probe_times

PROBE_VERSION = "v4"  # bump when the probe's method changes: old curves are then ignored
# a pass-cost curve is the low end of this many probes, one taken by each of the first
# processes that need it: a probe beside a busy process (measured: t(16)/t(1) 0.57 or 2.13
# against 1.67-1.73 quiet, issue 65) is outvoted by quieter ones, as noise only adds time
PROBES = 3
# a saved chooser whose rounds found the curve off by more than this at some width has its
# target probed again (a short probe, its low end kept) by the next process that resumes it
CONTRADICTED = 1.5
# a later probe (~24 one-token passes) waits for a run that asks for at least this many
# tokens: on a short run it would cost more than it could gain (40 tokens of a slow pair:
# over half the run). The rounds of every run lower the curve for free (ChooserStore.save).
LATER_PROBE_TOKENS = 512
# the most drafts a round may verify: no drafter is right that far ahead, and each draft
# asked for costs a draft step and a row of the target's pass (a batch pads every row to it)
K_MAX = 32


@dataclass(frozen=True)
class K:
    """k as it was asked for, parsed once (``K.of``): ``fixed`` drafts a round, or adaptive
    when ``fixed`` is None. Text, JSON and models.toml all come through ``of``."""

    fixed: int | None = None

    @classmethod
    def of(cls, value: K | int | str, name: str = "k") -> K:
        """'auto', an integer from 0 to K_MAX (or its text), or a K as it is; BadInput
        otherwise, naming the setting as ``name`` (the CLI's "-k"): the one place k is
        checked."""
        if isinstance(value, K):
            return value
        if value == "auto":
            return cls(None)
        n = count_of(value)
        if n is None or not 0 <= n <= K_MAX:
            raise BadInput(f"{name} must be an integer from 0 to {K_MAX} or 'auto', got {value!r}")
        return cls(n)

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def __str__(self) -> str:
        return "auto" if self.fixed is None else str(self.fixed)

    @property
    def value(self) -> int | str:
        """As JSON and models.toml write it: the int, or "auto"."""
        return "auto" if self.fixed is None else self.fixed


AUTO = K(None)


def count_of(value: object) -> int | None:
    """An int setting as given (an int, or its text), None for anything else (a bool is
    not a count): what K.of and trees.TreeSize.of read before their own range checks."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class FixedK(KChooser):
    """A fixed k, as a chooser: lookup verifies up to k (the protocol's default), and it
    does not plan drafts.

    k: the drafts a round; cost: the target's pass-cost curve (its probe, untimed), which a
    token tree's ``auto`` sizer reads as it reads an adaptive chooser's (trees.pass_cost;
    None: CostCurve's guessed shape). The k itself reads nothing."""

    def __init__(self, k: int, cost: CostCurve | None = None):
        self.k, self.cost = k, cost

    def __call__(self, _last: RoundReport | None) -> int:
        return self.k

    def plain_next(self) -> bool:
        return self.k == 0


def make_chooser(k: K, pass_ratio: list[float] | None = None) -> KChooser:
    """A fresh chooser for ``k``: FixedK, or an AdaptiveK (ChooserStore.get gives one that
    carries what earlier runs learned). pass_ratio: the target's probed pass-cost curve, for
    both to start from (None: guessed)."""
    cost = CostCurve(pass_ratio=pass_ratio)
    return AdaptiveK(cost=cost) if k.auto else FixedK(k.fixed, cost)


# what a drafter's agreement measured before any round is worth in trials (AdaptiveK.expect):
# self-drafting's auto measures it over a 256-token passage of other text than the prompt's
PRIOR_TRIALS = 16


def for_drafter(chooser: KChooser, draft: object | None) -> KChooser:
    """``chooser`` set for its drafter: an adaptive one over a block drafter (a ``block_size``,
    DFlash's) charges a round's drafting once, whatever k, and may draft up to block - 1
    (AdaptiveK.block); one over a drafter whose greedy ``agreement`` with the target was
    measured (self-drafting's auto exit) starts from it, worth PRIOR_TRIALS trials, where it
    has learned nothing yet; anything else is left as it is.

    chooser: the k chooser; draft: the draft model or head (None: nothing drafts but lookup)."""
    block = getattr(draft, "block_size", 0) or 0
    agreement = getattr(draft, "agreement", None)
    if isinstance(chooser, AdaptiveK) and block > 0:
        chooser.block, chooser.k_max = True, block - 1
    if isinstance(chooser, AdaptiveK) and agreement is not None:
        chooser.expect(agreement, PRIOR_TRIALS)
    return chooser


def state_path(kind: str, identity: str) -> Path:
    """A file under $SPECMLX_HOME/kind for this machine, backend, BLAS, MLX and ``identity``
    (what a measurement there belongs to)."""
    return _state_path(kind, identity)


def _state_path(kind: str, identity: str) -> Path:
    """A file under $SPECMLX_HOME/kind for this machine, backend, BLAS, MLX and ``identity``."""
    key = f"{machine_id(str(mx.default_device()))}|{identity}"
    return specmlx_home() / kind / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


class ChooserStore:
    """Adaptive-k choosers by (target identity, drafter identity, sampler, machine).

    persist: read and write $SPECMLX_HOME (False: memory only, as the bench wants).
    pass_ratio: a measured pass-cost curve for fresh choosers (default: probe the target once,
    cached on disk by the target's identity). warn: gets one line when a write fails.
    """

    def __init__(
        self,
        *,
        persist: bool = True,
        pass_ratio: list[float] | None = None,
        warn: Warn | None = None,
    ):
        self.persist, self.pass_ratio, self.warn = persist, pass_ratio, warn
        self._live: dict[str, AdaptiveK] = {}
        self._paths: dict[int, Path] = {}
        self._probes: dict[str, dict] = {}  # by probe key: the probe records this store knows
        self._targets: dict[int, str] = {}  # by chooser: its target's identity
        self._probed: set[str] = set()  # probe keys this store ran a probe for
        # by chooser: where its state came from ("this process", "saved", "saved, probed
        # again (...)", "saved (a probe waits ...)", "new: probed now", "new: a saved probe",
        # "new: the ranks' probe"),
        # what --json says it decided from
        self._origins: dict[int, str] = {}
        self._warned = False

    @staticmethod
    def key(
        target_id: str, drafter_id: str, sampling: SamplingParams, verify: str = DEFAULT_VERIFY
    ) -> str:
        """The identity a chooser's estimates belong to (the machine is added on disk).
        Sampled block verification keeps more drafts, so it learns apart (greedy decoding is
        the same under both rules); token-wise keys stay as they were before block
        verification existed, so saved state still applies."""
        rule = "" if verify == "token" or sampling.greedy else f"|verify={verify}"
        return f"{target_id}|{drafter_id}|{sampling_key(sampling)}{rule}"

    def get(
        self,
        target: nn.Module,
        target_id: str,
        drafter_id: str,
        sampling: SamplingParams,
        prompt_ids: Sequence[int],
        *,
        verify: str = DEFAULT_VERIFY,
        tokens: int | None = None,
    ) -> AdaptiveK:
        """The chooser for this pair and sampler: live, else as the last run left it on disk,
        else fresh and seeded with the target's pass-cost curve (probed over ``prompt_ids``).

        target: the target model (probed only when no curve is known); target_id and
        drafter_id: full model identities (registry.ModelSpec.identity; "lookup" or "none"
        for drafters without a model); sampling: the sampler, since acceptance depends on it;
        prompt_ids: what a probe runs over; verify: the acceptance rule ("token", "block");
        tokens: the most the run will generate (below LATER_PROBE_TOKENS no later probe runs;
        None: unknown, as long).
        """
        long = tokens is None or tokens >= LATER_PROBE_TOKENS
        key = self.key(target_id, drafter_id, sampling, verify)
        if key in self._live:
            self._origins[id(self._live[key])] = "this process"
            return self._live[key]
        path = _state_path("adaptive", key)
        chooser = None
        state = load_json(path) if self.persist else None
        if state is not None:
            chooser = _restored(state)
            if chooser is None and self.warn is not None:
                self.warn(f"ignoring {path}: it does not fit this version of specmlx")
        origin = "saved"
        if chooser is not None and self.pass_ratio is None:
            # a saved chooser reads the probes' curve (their low end): one more probe while
            # fewer than PROBES have run, or whenever its rounds found the curve off by over
            # CONTRADICTED at some width (every probe so far beside a busy process); a curve
            # not the one it was saved with drops its corrections (they were against the old)
            # (a short run probes nothing: a contradiction waits, its fixes kept, for a long one)
            off = contradicted(chooser.cost)
            wanted = self.probes_wanted(target_id) or off
            again = wanted and long
            if again:
                ratio = self.probe(target, target_id, list(prompt_ids), again=off)
            else:
                ratio = self.cached_probe(target_id)
            if ratio is not None and ((off and again) or ratio != chooser.cost.pass_ratio):
                # (contradicted: the fixes go even where the probe confirmed the curve, so a
                # lasting contradiction costs one short probe each time it is learned again)
                chooser.cost.pass_ratio, chooser.cost.fix = ratio, {}
            if again:
                n = self._probe_record(target_id, SUFFIX_MAX)["probes"]
                why = "its rounds contradicted the curve" if off else f"{n} of {PROBES}"
                origin = f"saved, probed again ({why})"
            elif wanted:
                origin = f"saved (a probe waits for a run of {LATER_PROBE_TOKENS}+ tokens)"
        if chooser is None:
            known = self._probe_record(target_id, SUFFIX_MAX) is not None
            probed = self.pass_ratio is None and self.probes_wanted(target_id)
            probed = probed and (long or not known)  # (a first probe always runs)
            origin = "new: " + (
                "the ranks' probe" if self.pass_ratio is not None
                else "probed now" if probed else "a saved probe"
            )  # fmt: skip
            ratio = self.curve(target, target_id, prompt_ids, long=long)
            chooser = AdaptiveK(cost=CostCurve(pass_ratio=ratio))
        self._live[key] = chooser
        self._targets[id(chooser)] = target_id
        self._paths[id(chooser)] = path
        self._origins[id(chooser)] = origin
        return chooser

    def origin(self, chooser: AdaptiveK) -> str:
        """Where ``chooser``'s state came from when this process first got it (``get``), or
        "this process" once it has run here already."""
        return self._origins.get(id(chooser), "this process")

    def save(self, chooser: AdaptiveK) -> None:
        """Keep what ``chooser`` learned for the next run (best effort), and lower its
        target's probed curve where its rounds ran a pass faster than the probes did."""
        path = self._paths.get(id(chooser))
        if self.persist and path is not None:
            self._save(path, {"state": chooser.state()})
        self._lower(chooser)

    def _lower(self, chooser: AdaptiveK) -> None:
        """Lower the probe record of ``chooser``'s target to its fastest rounds, size by size
        (a round over n tokens is at least a pass over n tokens, at a longer context than the
        probe's: faster only where a probe was slowed), so that the next process reads a
        curve no busy probe holds up, without probing again. The choices of this process
        keep their curve (a chooser's corrections are against it)."""
        target_id = self._targets.get(id(chooser))
        fastest = chooser.cost.fastest
        if target_id is None or self.pass_ratio is not None or not fastest:
            return
        record = self._probe_record(target_id, SUFFIX_MAX)
        if record is None:
            return
        times = dict(record["times"])
        for k, t in fastest.items():
            if k + 1 in times and t < times[k + 1]:
                times[k + 1] = t
        if times == record["times"]:
            return
        record = {**record, "times": times, "ratio": curve_from(times, SUFFIX_MAX)}
        key = _probe_key(target_id, SUFFIX_MAX)
        self._probes[key] = record
        if self.persist:
            self._save(_state_path("probes", key), record)

    def curve(
        self, target: nn.Module, target_id: str, prompt_ids: Sequence[int], long: bool = True
    ) -> list[float]:
        """The pass-cost curve fresh choosers start from: the store's ``pass_ratio``, else the
        target's probe (``probe``: cached on disk, else run over ``prompt_ids``; ``long``: the
        run can pay for a later probe)."""
        return self.pass_ratio or self.probe(target, target_id, list(prompt_ids), long=long)

    def known_curve(self, target_id: str) -> list[float] | None:
        """The pass-cost curve known without running anything: the store's ``pass_ratio``,
        else a probe already run (``cached_probe``), else None."""
        return self.pass_ratio or self.cached_probe(target_id)

    def cached_probe(self, target_id: str, k_max: int = SUFFIX_MAX) -> list[float] | None:
        """The target's pass-cost curve from an earlier probe on this machine, if any: one
        this store ran or read (kept in memory, so a store that does not persist answers the
        same for the whole process: a lone row's trees and its batch's read one curve), else
        one on disk."""
        record = self._probe_record(target_id, k_max)
        return record["ratio"] if record is not None else None

    def probe(
        self,
        target: nn.Module,
        target_id: str,
        ids: list[int],
        k_max: int = SUFFIX_MAX,
        *,
        again: bool = False,
        long: bool = True,
    ):
        """The target's pass-cost curve, cached by identity: per token count the fastest of
        the probes run so far, one by each of the first PROBES processes that ask (this one
        runs one now when none has, or when fewer than PROBES have and it has not, or when
        ``again``: rounds contradict the curve; a later probe is a short one, each size
        timed once, no warm-up), then saved.

        target: the model to time; target_id: its full identity (the key); ids: a prompt to
        prefill before timing; k_max: the last k of the curve; again: probe once more in
        this process whatever has run (a chooser's rounds contradict the curve); long: the
        run is long enough to pay for a later probe (False: only a first one runs)."""
        key = _probe_key(target_id, k_max)
        record = self._probe_record(target_id, k_max)
        done = record is not None and (record["probes"] >= PROBES or key in self._probed)
        if record is not None and (not long or (done and not (again and key not in self._probed))):
            return record["ratio"]
        # the first probe times each size 3 times after a warm-up round; a later one once,
        # cold (it only ever lowers the kept times: a cold, slow timing is just not kept)
        first = record is None
        times = probe_times(target, ids, k_max, 3 if first else 1, warm=first)
        if record is not None:  # the low end of every probe so far, size by size
            times = {n: min(t, record["times"].get(n, t)) for n, t in times.items()}
        record = {
            "identity": target_id,
            "times": times,
            "probes": (record["probes"] if record is not None else 0) + 1,
            "ratio": curve_from(times, k_max),
        }
        self._probes[key], self._probed = record, self._probed | {key}
        if self.persist:
            self._save(_state_path("probes", key), record)
        return record["ratio"]

    def probes_wanted(self, target_id: str, k_max: int = SUFFIX_MAX) -> bool:
        """Whether ``probe`` would run one now: fewer than PROBES so far, none by this store."""
        record = self._probe_record(target_id, k_max)
        key = _probe_key(target_id, k_max)
        return record is None or (record["probes"] < PROBES and key not in self._probed)

    def _probe_record(self, target_id: str, k_max: int) -> dict | None:
        """The probe record (times by token count, probes so far, the curve) this store ran
        or read, else the one on disk (None: none, or one not of this shape)."""
        key = _probe_key(target_id, k_max)
        if key not in self._probes:
            got = load_json(_state_path("probes", key)) if self.persist else None
            try:
                times = {int(n): float(t) for n, t in got["times"].items()}
                record = {**got, "times": times, "probes": int(got["probes"])}
                if not (isinstance(got["ratio"], list) and times and 1 in times):
                    return None
            except (TypeError, KeyError, ValueError, AttributeError):
                return None
            self._probes[key] = record
        return self._probes[key]

    def _save(self, path: Path, data: dict) -> None:
        # one warning per store: a read-only home would otherwise repeat it every request
        if not save_json(path, data, None if self._warned else self.warn):
            self._warned = True


def _probe_key(target_id: str, k_max: int) -> str:
    """A probe record's identity: the target, the curve's last k, the probe's method."""
    return f"{target_id}|{k_max}|{PROBE_VERSION}"


def contradicted(cost: CostCurve) -> bool:
    """Whether rounds found the probed curve off by more than CONTRADICTED at some width
    (CostCurve.fix: measured over probed, per k)."""
    return cost.pass_ratio is not None and any(
        not 1 / CONTRADICTED <= f <= CONTRADICTED for f in (cost.fix or {}).values()
    )


def sampling_key(s: SamplingParams) -> str:
    """The sampler's part of a chooser's key, field by field, so that a new field of
    SamplingParams leaves the keys already saved as they are."""
    return f"temp={s.temperature:g}|top_p={s.top_p:g}|top_k={s.top_k}|min_p={s.min_p:g}"


def _restored(state: dict) -> AdaptiveK | None:
    """The chooser a state file describes, or None when it cannot be one: from another
    version, or valid JSON of the wrong shape (a list where a number belongs, ...), which
    would otherwise fail later, on every request. A copy is put through a few rounds first."""
    try:
        chooser = AdaptiveK.resume(state["state"])
        trial = copy.deepcopy(chooser)
        for report in (None, RoundReport(2, 1, 0.1, 0.02), RoundReport(0, 0, 0.05)):
            int(trial(report))
        trial.draft_plan([0.5], drafted=1)
        trial.lookup_length(2, 3, 2, True)
    except Exception:  # noqa: BLE001 - whatever is wrong with it, a fresh chooser will do
        return None
    return chooser
