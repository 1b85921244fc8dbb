"""The k-setting resolver and the chooser store: identity keys, best-effort state files,
atomic writes under concurrency."""

from __future__ import annotations

import json
import threading

import pytest
from helpers import Feed, make_tiny, steady

from specmlx.core.sampling import SamplingParams
from specmlx.core.stats import KChooser
from specmlx.drafting.choosing import choosers
from specmlx.drafting.choosing.adaptive import STATE_VERSION, SUFFIX_MAX, AdaptiveK
from specmlx.drafting.choosing.choosers import (
    AUTO,
    K_MAX,
    ChooserStore,
    FixedK,
    K,
    make_chooser,
    sampling_key,
)
from specmlx.errors import BadInput
from specmlx.models.registry import load_registry
from specmlx.paths import atomic_write, load_json, save_json

GREEDY, WARM = SamplingParams(), SamplingParams(0.8, 0.95)


def test_k_is_parsed_once_and_makes_its_chooser():
    assert K.of(3) == K.of("3") == K(3) and K.of(K(3)) == K(3) and K.of("auto") == AUTO
    assert str(K(3)) == "3" and str(AUTO) == "auto" and K(2).value == 2 and AUTO.value == "auto"
    assert isinstance(make_chooser(K(3)), FixedK) and make_chooser(K(0)).plain_next()
    assert isinstance(make_chooser(AUTO), AdaptiveK)
    assert K.of(K_MAX) == K(K_MAX)
    for bad in (-1, "many", 2.5, True, "-2", None, K_MAX + 1, "1000"):
        with pytest.raises(BadInput, match=f"k must be an integer from 0 to {K_MAX} or 'auto'"):
            K.of(bad)


def test_every_chooser_declares_the_abilities_the_engine_asks_for():
    """plain_next, lookup_length and draft_plan are the protocol's, not found by getattr: a
    fixed k verifies a lookup up to k and does not plan; adaptive k plans."""
    fixed, auto = FixedK(3), AdaptiveK()
    assert isinstance(fixed, KChooser) and isinstance(auto, KChooser)
    assert (
        fixed.lookup_length(2, 9, 3, draft=False) == 3 and fixed.lookup_length(2, 1, 3, True) == 1
    )
    assert not fixed.plans and auto.plans and not fixed.plain_next()
    with pytest.raises(NotImplementedError):
        fixed.draft_plan([0.9])


def test_store_resumes_per_pair_and_sampler(specmlx_home, monkeypatch):
    # (one probe: the next run takes no second; test_a_curve_is_the_low_end_of_three_probes)
    monkeypatch.setattr(choosers, "PROBES", 1)
    model, ids = make_tiny(0), [1, 2, 3, 4]
    store = ChooserStore()
    fresh = store.get(model, "t", "d", GREEDY, ids)
    assert fresh.cost.level is None and len(fresh.cost.pass_ratio) == SUFFIX_MAX + 1  # the probe
    assert store.get(model, "t", "d", GREEDY, ids) is fresh  # live in this process
    steady(Feed(fresh), 30, accept=0.7)
    store.save(fresh)
    again = ChooserStore().get(model, "t", "d", GREEDY, ids)  # the next run
    assert again.state() == fresh.state() and again.best_now() == fresh.best_now()
    assert ChooserStore().get(model, "t", "d", WARM, ids).cost.level is None  # its own sampler
    assert ChooserStore().get(model, "t", "d2", GREEDY, ids).cost.level is None  # its own drafter
    for f in (specmlx_home / "adaptive").glob("*.json"):
        f.write_text("{not json")  # a damaged file is ignored, not fatal
    assert ChooserStore().get(model, "t", "d", GREEDY, ids).cost.level is None
    assert ChooserStore(persist=False).get(model, "t", "d", GREEDY, ids).cost.level is None


def test_a_state_file_of_the_wrong_shape_is_ignored_with_one_warning(specmlx_home):
    """Valid JSON that cannot be a chooser (a list where a number belongs) made every auto
    request fail until the file was deleted; now it is set aside, with a warning."""
    model, ids = make_tiny(0), [1, 2, 3, 4]
    store = ChooserStore()
    store.save(store.get(model, "t", "d", GREEDY, ids))
    (path,) = (specmlx_home / "adaptive").glob("*.json")
    warnings = []
    v = STATE_VERSION
    wrong = [{"version": v, "_fix": [1.0, 1.0]}, {"version": v, "level": [1]}, [], {"level": 0.1}]
    for bad in ({"state": w} for w in wrong):
        path.write_text(json.dumps(bad))
        chooser = ChooserStore(warn=warnings.append).get(model, "t", "d", GREEDY, ids)
        assert chooser.cost.level is None and isinstance(chooser(None), int)
    assert len(warnings) == 4 and all("does not fit" in w for w in warnings)


def test_only_what_was_learned_is_saved_so_changed_defaults_reach_saved_state(specmlx_home):
    """Settings saved with the estimates once kept a machine on old defaults forever."""
    model, ids = make_tiny(0), [1, 2, 3, 4]
    store = ChooserStore()
    chooser = store.get(model, "t", "d", GREEDY, ids)
    chooser.explore, chooser.k_max = 5.0, 3  # as if the defaults had been these
    steady(Feed(chooser), 30, accept=0.7)
    store.save(chooser)
    (path,) = (specmlx_home / "adaptive").glob("*.json")
    saved = json.loads(path.read_text())["state"]
    assert saved["version"] == STATE_VERSION and saved["level"] > 0
    assert "explore" not in saved and "k_max" not in saved
    again = ChooserStore().get(model, "t", "d", GREEDY, ids)
    assert (again.explore, again.k_max) == (AdaptiveK().explore, AdaptiveK().k_max)
    assert again.cost.level == chooser.cost.level and again.accept.first == chooser.accept.first


def test_the_key_names_each_sampling_field():
    key = ChooserStore.key("t", "d", SamplingParams(0.8, 0.95, 40, 0.05))
    assert key == "t|d|temp=0.8|top_p=0.95|top_k=40|min_p=0.05|verify=block"


def test_block_verification_learns_apart_when_sampling():
    key = ChooserStore.key
    # token-wise keys have no rule in them, as before block verification existed
    assert key("t", "d", WARM, "token") == f"t|d|{sampling_key(WARM)}"
    assert key("t", "d", WARM, "block") == key("t", "d", WARM) != key("t", "d", WARM, "token")
    assert key("t", "d", GREEDY, "block") == key("t", "d", GREEDY)  # greedy: the same rule


def test_float_and_quantized_models_do_not_share_state(specmlx_home):
    """The key was once `source|dtype`: a float target reused a curve probed on a 4-bit one."""
    reg = load_registry()
    pairs = [("smollm2-135m", "smollm2-135m-q4"), ("codellama-7b", "codellama-7b-q4")]
    for a, b in pairs:
        assert reg.resolve(a).identity != reg.resolve(b).identity, (a, b)
    model, ids, probes = make_tiny(0), [1, 2, 3], []
    store = ChooserStore()
    store.probe = lambda m, ident, i, k_max=8, **kw: probes.append(ident) or [1.0] * 9
    for a, b in pairs:
        for name in (a, b):
            store.get(model, reg.resolve(name).identity, "none", GREEDY, ids)
    assert len(set(probes)) == 4  # each target probed for itself


def test_a_read_only_home_costs_one_warning(tmp_path, monkeypatch):
    """The default -k auto once crashed when the probe could not be saved."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SPECMLX_HOME", str(blocker / "home"))  # mkdir fails: not a directory
    warnings: list[str] = []
    store = ChooserStore(warn=warnings.append)
    chooser = store.get(make_tiny(0), "t", "d", GREEDY, [1, 2, 3])
    steady(Feed(chooser), 10, accept=0.5)
    store.save(chooser)
    store.save(chooser)
    assert len(warnings) == 1 and "could not save" in warnings[0], warnings


def test_atomic_writes_from_two_writers_at_once(tmp_path):
    """Two processes (or server requests) saving one state file: every read sees a whole
    file, and neither writer fails (a fixed `.tmp` name made them rename each other's file)."""
    path = tmp_path / "state" / "s.json"
    payloads = [{"writer": w, "pad": "x" * 50_000} for w in range(2)]
    errors, bad_reads = [], []

    def write(data):
        try:
            for _ in range(150):
                atomic_write(path, json.dumps(data))
        except OSError as e:
            errors.append(e)

    def read():
        for _ in range(300):
            if path.exists():
                got = load_json(path)
                if got not in payloads:
                    bad_reads.append(got)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    threads.append(threading.Thread(target=read))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not bad_reads
    assert load_json(path) in payloads
    assert sorted(p.name for p in path.parent.iterdir()) == ["s.json"]  # no temp files left
    assert save_json(tmp_path / "state" / "t.json", {"a": 1}) and load_json(
        path.with_name("t.json")
    )


def test_a_store_that_does_not_persist_probes_once_and_answers_with_it(monkeypatch):
    """A store that does not persist probed again for each new chooser, and a server's
    batch, which reads only a probe already run, found none: a lone row's trees and its
    batch's were sized from two curves."""
    runs = []
    monkeypatch.setattr(
        choosers, "probe_times", lambda *a, **kw: runs.append(1) or {1: 1.0, 2: 1.5}
    )
    store, model = ChooserStore(persist=False), make_tiny(0)
    assert store.cached_probe("t") is None
    ratio = store.curve(model, "t", [1, 2])
    assert ratio[:2] == [1.0, 1.5] and ratio == store.probe(model, "t", [1, 2])
    assert store.cached_probe("t") == ratio and store.cached_probe("u") is None
    assert len(runs) == 1


def test_a_curve_is_the_low_end_of_three_probes_one_a_process(monkeypatch, specmlx_home):
    """A probe taken beside a busy process mismeasures the curve (issue 65): the curve kept
    on disk is, size by size, the fastest of PROBES probes, one by each of the first PROBES
    processes (stores) that need it; a saved chooser reads the lowered curve, its corrections
    of the old one dropped, and says so in --json's "from"."""
    busy = {1: 2.0, 2: 2.1, 16: 2.4, 32: 3.0}  # t(1) slowed most: wide passes look cheap
    quiet = {1: 1.0, 2: 1.2, 16: 1.7, 32: 2.6}
    runs = []
    monkeypatch.setattr(
        choosers, "probe_times", lambda *a, **kw: runs.append((*a[3:], kw)) or dict(times.pop(0))
    )  # (each call's repetitions and warm-up: the first probe is the full one, later ones short)
    times = [busy, quiet, {n: t * 1.5 for n, t in quiet.items()}, quiet]
    model, greedy = make_tiny(0), SamplingParams(0.0)
    first = ChooserStore()
    chooser = first.get(model, "t", "none|lookup=True", greedy, [1, 2])
    assert first.origin(chooser) == "new: probed now" and len(runs) == 1
    assert chooser.cost.pass_ratio[15] == pytest.approx(2.4 / 2.0)
    first.probe(model, "t", [1, 2])  # (one probe a process)
    chooser.cost.fix = {15: 0.8}  # (within CONTRADICTED: it alone would not probe again)
    first.save(chooser)
    second = ChooserStore()
    again = second.get(model, "t", "none|lookup=True", greedy, [1, 2])
    assert second.origin(again) == f"saved, probed again (2 of {choosers.PROBES})"
    assert again.cost.pass_ratio[15] == pytest.approx(1.7) and again.cost.fix == {}
    third = ChooserStore()  # slower all over: nothing of it is kept
    assert third.probe(model, "t", [1, 2])[15] == pytest.approx(1.7) and len(runs) == 3
    fourth = ChooserStore()  # PROBES reached: no probe runs any more
    assert fourth.get(model, "t", "none|lookup=True", greedy, [1, 2]).cost.pass_ratio[31] == (
        pytest.approx(2.6)
    )
    assert fourth.origin(fourth._live[next(iter(fourth._live))]) == "saved" and len(runs) == 3
    assert json.loads(next((specmlx_home / "probes").iterdir()).read_text())["probes"] == 3
    # rounds that find the curve off by over CONTRADICTED at some width: one more (short)
    # probe by the next process, however many ran, and the chooser learns its fixes afresh
    resumed = fourth.get(model, "t", "none|lookup=True", greedy, [1, 2])
    resumed.cost.fix = {4: 1.1, 15: choosers.CONTRADICTED * 1.2}
    fourth.save(resumed)
    fifth = ChooserStore()
    again = fifth.get(model, "t", "none|lookup=True", greedy, [1, 2])
    assert fifth.origin(again) == "saved, probed again (its rounds contradicted the curve)"
    assert (
        len(runs) == 4
        and again.cost.fix == {}
        and again.cost.pass_ratio[15] == (pytest.approx(1.7))
    )
    fifth.save(again)
    assert ChooserStore().get(model, "t", "none|lookup=True", greedy, [1, 2]) and len(runs) == 4
    assert runs == [(3, {"warm": True})] + [(1, {"warm": False})] * 3


def test_rounds_faster_than_the_probe_lower_the_curve_for_the_next_process(
    monkeypatch, specmlx_home
):
    """A probe beside a busy process holds the curve up where it was slowed; a round's pass
    (lookup, plain, drafting timed apart) is never faster than the pass itself, so the
    fastest rounds lower the probe's times size by size when the chooser is saved: the next
    process reads the lowered curve without probing again. This process's curve stays."""
    busy = {1: 1.0, 2: 1.3, 16: 3.0, 32: 4.5}  # wide passes slowed most
    runs = []
    monkeypatch.setattr(choosers, "probe_times", lambda *a, **kw: runs.append(1) or dict(busy))
    monkeypatch.setattr(choosers, "PROBES", 1)  # (no later probe: the rounds alone lower it)
    model, greedy = make_tiny(0), SamplingParams(0.0)
    store = ChooserStore()
    chooser = store.get(model, "t", "none|lookup=True", greedy, [1, 2])
    assert chooser.cost.pass_ratio[15] == pytest.approx(3.0)
    chooser.update(15, 15, 1.8, lookup=8)  # a lookup round over 16 tokens in 1.8 s
    chooser.update(15, 15, 2.5, lookup=8)  # (slower: the fastest counts)
    chooser.update(0, 0, 0.5)  # a plain step: its pass may have begun in the round before
    chooser.update(3, 1, 2.0, draft_s=None)  # drafting not timed apart: no evidence
    store.save(chooser)
    assert chooser.cost.pass_ratio[15] == pytest.approx(3.0)  # (this process keeps its own)
    record = json.loads(next((specmlx_home / "probes").iterdir()).read_text())
    assert record["times"] == {"1": 1.0, "2": 1.3, "16": 1.8, "32": 4.5}
    assert record["probes"] == 1
    again = ChooserStore().get(model, "t", "none|lookup=True", greedy, [1, 2])
    assert again.cost.pass_ratio[15] == pytest.approx(1.8) and again.cost.fix == {}
    assert len(runs) == 1
    # a store given its curve (the ranks') lowers nothing
    given = ChooserStore(pass_ratio=[1.0] * 32)
    c = given.get(model, "u", "none|lookup=True", greedy, [1, 2])
    c.update(15, 15, 0.1, lookup=8)
    given.save(c)
    assert len(list((specmlx_home / "probes").iterdir())) == 1


def test_a_short_run_pays_for_no_later_probe(monkeypatch, specmlx_home):
    """A later probe costs ~24 one-token passes: on a 40-token run of a slow pair, over half
    the run. A run asking fewer than LATER_PROBE_TOKENS runs none (a first probe always
    runs; a contradiction waits, its fixes kept, for a long run)."""
    runs = []
    monkeypatch.setattr(
        choosers, "probe_times", lambda *a, **kw: runs.append(1) or {1: 1.0, 2: 1.2, 32: 2.0}
    )
    model, greedy = make_tiny(0), SamplingParams(0.0)
    short, long = 40, choosers.LATER_PROBE_TOKENS
    first = ChooserStore()
    chooser = first.get(model, "t", "none|lookup=True", greedy, [1, 2], tokens=short)
    assert first.origin(chooser) == "new: probed now" and len(runs) == 1
    chooser.cost.fix = {4: choosers.CONTRADICTED * 1.2}
    first.save(chooser)
    second = ChooserStore()
    resumed = second.get(model, "t", "none|lookup=True", greedy, [1, 2], tokens=short)
    assert second.origin(resumed) == "saved (a probe waits for a run of 512+ tokens)"
    assert len(runs) == 1
    assert resumed.cost.fix == {4: choosers.CONTRADICTED * 1.2}  # (kept for a long run)
    other = second.get(model, "t", "none|lookup=False", greedy, [1, 2], tokens=short)
    assert second.origin(other) == "new: a saved probe" and len(runs) == 1
    third = ChooserStore()
    resumed = third.get(model, "t", "none|lookup=True", greedy, [1, 2], tokens=long)
    assert third.origin(resumed) == "saved, probed again (its rounds contradicted the curve)"
    assert len(runs) == 2 and resumed.cost.fix == {}
