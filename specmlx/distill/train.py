"""Train a draft for a target by distillation (DistillSpec, Zhou et al. 2023, arXiv 2310.08461).

The student is the target cut down: the target's own embeddings, final norm and LM head (so
the vocabulary is the same by construction) and L of its blocks, picked evenly (same widths),
trained with MLX to match the target's next-token distribution. Or, with ``--head``, a head
over the target's hidden states (EAGLE-3, DFlash or MTP, heads.py) trained to match the same
distributions from the target's features. The target labels the data once: the top-k of its
log-probabilities at every position (and, for a head, its features at the head's layers),
kept on disk with the run, so a step costs one pass of what is trained and its backward pass,
and a resumed run reads the same labels.

    data (token ids)  ->  teacher top-k (N, L, k) [+ features]  ->  steps  ->  a model dir

The run is a generator of `Event`s; the CLI draws them. Nothing here prints. Here the
resumable run (labels cached on disk, checkpoints, the finished directory); what it trains
(the settings, data, labels, losses; the student, student.py; the heads, heads.py) is apart.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import BadInput
from ..models.loading import Loaded
from ..paths import atomic_write, load_json
from .heads import head_trainee
from .student import (
    DistillConfig,
    Trainee,
    features,
    label,
    read_data,
    sample_rows,
    student_trainee,
    teacher_probs,
    trainable,
)


@dataclass
class Event:
    """One thing a run reports. phase: "data" | "label" | "train" | "eval" | "saved" | "done";
    done/total: progress within the phase; loss: the step's loss (train); metrics: held-out
    estimates (eval, done); seconds: wall time of the run so far (across resumes)."""

    phase: str
    done: int = 0
    total: int = 0
    loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


# ---------------------------------------------------------------- the run


def _schedule(config: DistillConfig):
    decay = optim.cosine_decay(config.lr, max(config.steps - config.warmup, 1), config.lr / 10)
    if config.warmup == 0:
        return decay
    warm = optim.linear_schedule(config.lr / config.warmup, config.lr, config.warmup)
    return optim.join_schedules([warm, decay], [config.warmup])


def batch_rows(config: DistillConfig, step: int, n: int) -> np.ndarray:
    """The rows step `step` trains on: a function of (seed, step) alone, so a resumed run
    sees the same batches as one that never stopped."""
    return np.random.default_rng([config.seed, step]).choice(n, config.batch, replace=False)


def _save_dir(tmp: Path, final: Path) -> None:
    # the old one aside, the new one in, the old one gone: a crash at any point leaves a
    # whole checkpoint under `final` or `.final.old` (which _open_run puts back)
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(out: Path, model, opt, state: dict) -> None:
    """Trainable weights, AdamW's state and the run's state under out/checkpoint, atomically."""
    tmp = out / f".checkpoint.tmp{time.monotonic_ns()}"
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "student.safetensors"), trainable(model))
    mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    _save_dir(tmp, out / "checkpoint")


def _load_labels(path: Path) -> dict[str, mx.array] | None:
    try:
        return dict(mx.load(str(path)))
    except (OSError, RuntimeError, ValueError):
        return None


def _run_key(target: Loaded, config: DistillConfig, data: str) -> dict:
    # What a checkpoint must agree on to be resumed: everything but how often to save/eval.
    run = {k: v for k, v in asdict(config).items() if k not in ("eval_every", "save_every")}
    return {"target": target.identity or target.spec.identity, "data": str(data), **run}


def _open_run(out: Path, key: dict, resume: bool, force: bool) -> dict | None:
    """Check out for a run to start or resume; the resumed run's state, or None."""
    old = out / ".checkpoint.old"
    if old.is_dir() and not (out / "checkpoint").exists():
        old.rename(out / "checkpoint")  # a crash while swapping checkpoints
    state = load_json(out / "checkpoint" / "state.json") if resume else None
    if resume and state is None:
        raise BadInput(f"nothing to resume in {out} (no checkpoint/state.json)")
    if state is not None and state["key"] != key:
        diff = sorted(k for k in key if state["key"].get(k) != key[k])
        raise BadInput(f"the checkpoint in {out} is of another run (differs in {', '.join(diff)})")
    if not resume and out.exists() and any(out.iterdir()):
        if not force:
            raise BadInput(f"{out} is not empty: --resume continues its run, --force starts over")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return state


def _labels(teacher, rows: np.ndarray, config: DistillConfig, reads: tuple, out: Path,
            rates: dict, clock):  # fmt: skip
    """The training rows and the teacher's top-k on them (and its features at ``reads``), from
    out/labels.safetensors or made now (and saved there); yields "label" Events, returns
    {"rows", "idx", "logp"} (and "feats")."""
    labels = _load_labels(out / "labels.safetensors")
    if labels is not None and labels["rows"].shape[0] == len(rows):
        return labels
    parts: dict[str, list] = {}
    made, since = [], clock()
    if config.data_from == "target":
        for done, toks, idx, logp in sample_rows(
            teacher, rows, config.top_k, config.batch, config.seed
        ):
            made.append(toks)
            parts.setdefault("idx", []).append(idx)
            parts.setdefault("logp", []).append(logp)
            yield Event("label", done, len(rows), seconds=clock())
        rows = np.concatenate(made)
        for done, feats in features(teacher, rows, config.batch, reads) if reads else ():
            parts.setdefault("feats", []).append(feats)  # a second pass, over what it wrote
            yield Event("label", done, len(rows), seconds=clock())
    else:
        for done, got in label(teacher, rows, config.top_k, config.batch, reads):
            for name, value in got.items():
                parts.setdefault(name, []).append(value)
            yield Event("label", done, len(rows), seconds=clock())
    rates["label_tokens"], rates["label_seconds"] = int(rows.size), clock() - since
    labels = {"rows": mx.array(rows), **{k: mx.concatenate(v) for k, v in parts.items()}}
    tmp = out / f".labels.tmp{time.monotonic_ns()}.safetensors"
    mx.save_safetensors(str(tmp), labels)
    tmp.rename(out / "labels.safetensors")
    return labels


def distill(
    target: Loaded,
    out: str | Path,
    config: DistillConfig,
    data: str | Path = "stdlib",
    *,
    resume: bool = False,
    force: bool = False,
) -> Iterator[Event]:
    """Train a student (or, with config.head, a head) for `target`, writing its directory to
    `out`.

    target: the loaded teacher (float weights); out: the directory (the model or head and
    distill.json; while it runs, labels.safetensors and checkpoint/); config: what to train
    (DistillConfig); data: "stdlib", a text file or a directory of them; resume: continue
    from out/checkpoint (it must come from the same target, data and config); force: start
    over in a directory that holds a run. Yields Events as it goes; the last is "done" with
    the final held-out estimates. Raises BadInput for what cannot run."""
    out = Path(out).expanduser()
    yield Event("data")
    rows, held = read_data(data, target.tokenizer, config)
    trainee = head_trainee(target, config, rows) if config.head else student_trainee(target, config)
    model = trainee.model
    key = _run_key(target, config, data)
    state = _open_run(out, key, resume, force)
    start, before = time.perf_counter(), (state or {}).get("seconds", 0.0)
    clock = lambda: before + time.perf_counter() - start  # noqa: E731
    rates = dict((state or {}).get("rates", {}))  # tokens and seconds of each kind of pass

    labels = yield from _labels(target.model, rows, config, trainee.reads, out, rates, clock)
    p_held, f_held = teacher_probs(target.model, mx.array(held), config.batch, trainee.reads)
    heldout = {"rows": mx.array(held), "p": p_held, **({"feats": f_held} if trainee.reads else {})}

    opt = optim.AdamW(learning_rate=_schedule(config), weight_decay=0.0)
    step, evals = 0, []
    if state is not None:
        ckpt = out / "checkpoint"
        model.load_weights(list(mx.load(str(ckpt / "student.safetensors")).items()), False)
        opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
        step, evals = state["step"], state["evals"]
    else:
        evals.append({"step": 0, "seconds": round(clock(), 1), **trainee.estimate(heldout)})
        yield Event("eval", 0, config.steps, metrics=evals[-1], seconds=clock())

    value_and_grad = nn.value_and_grad(model, trainee.loss)
    n = labels["rows"].shape[0]
    while step < config.steps:
        tick = time.perf_counter()
        take = mx.array(batch_rows(config, step, n))  # (batch,) row ids
        batch = {name: value[take] for name, value in labels.items()}
        loss, grads = value_and_grad({**batch, **trainee.extra(step, config.batch)})
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state, loss)
        step += 1
        rates["step_tokens"] = rates.get("step_tokens", 0) + config.batch * config.seq_len
        rates["step_seconds"] = rates.get("step_seconds", 0.0) + time.perf_counter() - tick
        yield Event("train", step, config.steps, loss=loss.item(), seconds=clock())
        if step == config.steps or (config.eval_every and step % config.eval_every == 0):
            metrics = trainee.estimate(heldout)
            evals.append({"step": step, "seconds": round(clock(), 1), **metrics})
            yield Event("eval", step, config.steps, metrics=metrics, seconds=clock())
        if step < config.steps and config.save_every and step % config.save_every == 0:
            state = {"key": key, "step": step, "seconds": clock(), "evals": evals, "rates": rates}
            save_checkpoint(out, model, opt, state)
            yield Event("saved", step, config.steps, seconds=clock())

    facts = {
        "target": target.spec.alias,
        "target_identity": key["target"],
        **trainee.facts,
        "target_layers": (target.config.get("text_config") or target.config)["num_hidden_layers"],
        "train_tokens": int(n * config.seq_len),
        "heldout_tokens": int(held.size),
        "data": str(data),
        "data_sha1": hashlib.sha1(np.array(labels["rows"]).tobytes()).hexdigest()[:12],
        "config": asdict(config),
        "evals": evals,
        "seconds": round(clock(), 1),
        **throughput(rates),
    }
    finish(out, trainee, facts)
    yield Event("done", step, config.steps, metrics=evals[-1], seconds=clock())


def throughput(rates: dict) -> dict[str, float]:
    """Tokens per second of the teacher's labelling passes and of the student's training
    steps (forward and backward), from a run's bookkeeping: what a run's cost scales by."""
    out = {}
    for name, tokens, seconds in (
        ("teacher_tokens_per_s", "label_tokens", "label_seconds"),
        ("student_tokens_per_s", "step_tokens", "step_seconds"),
    ):
        if rates.get(seconds):
            out[name] = round(rates[tokens] / rates[seconds], 1)
    return out


def finish(out: Path, trainee: Trainee, facts: dict) -> None:
    """The trained model's files (trainee.save), then distill.json, the mark of a finished
    run; the run's labels and checkpoint are removed."""
    trainee.save(out)
    atomic_write(out / "distill.json", json.dumps(facts, indent=1) + "\n")
    shutil.rmtree(out / "checkpoint", ignore_errors=True)
    (out / "labels.safetensors").unlink(missing_ok=True)
    for left in out.glob(".*.tmp*"):  # a crashed write's leftovers
        shutil.rmtree(left) if left.is_dir() else left.unlink()


def is_done(out: str | Path) -> bool:
    """True when a run finished in out (distill.json is written last)."""
    return (Path(out).expanduser() / "distill.json").is_file()


def registry_entry(
    name: str, out: Path, target_alias: str, target_source: str | None, label: str,
    kind: str = "",
) -> str:  # fmt: skip
    """A models.toml pairing the student (or a head of ``kind``: its draft is then
    ``kind:name``; an MTP head's directory is the target with the head, paired with "mtp")
    with its target. target_source: the target's source when it is not an alias of the
    shipped registry (a path or hf repo)."""
    if kind == "mtp":
        target_alias, target_source, draft = name, None, "mtp"
    else:
        draft = f"{kind}:{name}" if kind else name
    lines = [
        "# written by `specmlx distill`: SPECMLX_MODELS=<this file> specmlx run --target "
        f"{target_alias} --draft {draft} ... (or copy it into ~/.config/specmlx/models.toml)",
        f'[models."{name}"]',
        f'source = "local:{out}"',
        f'label = "{label}"',
    ]
    if target_source is not None:
        lines += [f'[models."{target_alias}"]', f'source = "{target_source}"']
    lines += [f'[pairs."{name}"]', f'target = "{target_alias}"', f'draft = "{draft}"', 'k = "auto"']
    return "\n".join(lines) + "\n"
