"""What a distillation run trains with (train.py runs it): its settings (DistillConfig),
the data's token rows, the target's top-k labels on them (or its own samples), the student
cut down from the target, and the losses and held-out estimates a step and an evaluation
take. Nothing here writes to disk or prints."""

from __future__ import annotations

import hashlib
import importlib
import math
import re
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..core.hidden import HiddenTap
from ..errors import BadInput
from ..models.loading import Loaded

INITS = ("spaced", "first", "random")
HEADS = ("", "eagle3", "dflash", "mtp")  # "": a student model; the others a head (heads.py)
LOSSES = ("kl", "tvd")
DATA_FROM = ("files", "target")
PROMPT_LEN = 16  # with data_from="target": the data's first tokens, then the target writes on
_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class DistillConfig:
    """What a distillation run does; `check` validates every value in one place.

    layers: the student's depth (blocks); init: "spaced" (evenly spaced target blocks, first
    and last included), "first" (the first L) or "random" (fresh blocks; embeddings and head
    still the target's); loss: "kl" (forward KL(p_T || q)) or "tvd" (total variation), both
    over the target's top-k ids and the rest of the vocabulary as one; data_from: "files"
    (the data as written) or "target" (the target's own samples at T = 1, each started from
    PROMPT_LEN tokens of the data); top_k: how many of the target's log-probs to keep per
    position; data_tokens: the labelled training pool, in tokens; heldout_tokens: held-out
    tokens (from other files) for the acceptance estimate; steps, batch, seq_len: training
    steps of batch sequences of seq_len tokens; lr, warmup: AdamW's peak learning rate after
    a linear warm-up of warmup steps, then cosine decay to lr / 10; seed: data order, the
    held-out split and random init; eval_every, save_every: steps between estimates and
    between checkpoints (0: only at the end).

    head: "" (a student model), "eagle3", "dflash" or "mtp" (a head over the target's hidden
    states, heads.py; ``layers`` is then DFlash's decoder layers, EAGLE-3 and MTP have one);
    depth: EAGLE-3's training-time-test steps (the head is unrolled that far each step; an
    MTP head is trained for its one step); draft_vocab:
    EAGLE-3's vocabulary (0: 32000 or the target's if smaller); width: EAGLE-3's hidden size
    (0: the target's); block: DFlash's block size (at most block - 1 drafts a round)."""

    layers: int = 4
    init: str = "spaced"
    loss: str = "kl"
    data_from: str = "files"
    top_k: int = 32
    data_tokens: int = 65536
    heldout_tokens: int = 1024
    steps: int = 200
    batch: int = 4
    seq_len: int = 256
    lr: float = 3e-4
    warmup: int = 20
    seed: int = 0
    eval_every: int = 50
    save_every: int = 50
    head: str = ""
    depth: int = 3
    draft_vocab: int = 0
    width: int = 0
    block: int = 16

    def check(self, target_layers: int) -> None:
        """Raise BadInput naming the first value that cannot work with this target."""
        if not 1 <= self.layers <= target_layers:
            raise BadInput(
                f"--layers must be 1..{target_layers} (the target has {target_layers} blocks); "
                f"got {self.layers}"
            )
        for name, allowed in (
            ("init", INITS), ("loss", LOSSES), ("data_from", DATA_FROM), ("head", HEADS)
        ):  # fmt: skip
            if getattr(self, name) not in allowed:
                shown = ", ".join(a for a in allowed if a)
                raise BadInput(f"--{name.replace('_', '-')} must be one of {shown}")
        if self.head in ("eagle3", "mtp") and self.layers != 1:
            kind = "an EAGLE-3" if self.head == "eagle3" else "an MTP"
            raise BadInput(f"--layers must be 1 for {kind} head (it has one decoder layer)")
        if self.head and self.init != "spaced":
            raise BadInput("--init picks a student's blocks: a head starts as heads.py says")
        for name, low in (("depth", 1), ("block", 2), ("draft_vocab", 0), ("width", 0)):
            if getattr(self, name) < low:
                raise BadInput(f"--{name.replace('_', '-')} must be >= {low}")
        if self.head == "dflash" and self.seq_len < self.block + 1:
            raise BadInput("--seq-len must be past --block (a block and its context in a row)")
        floor = PROMPT_LEN + 1 if self.data_from == "target" else 2
        for name, low in (("top_k", 1), ("steps", 1), ("batch", 1), ("seq_len", floor)):
            if getattr(self, name) < low:
                raise BadInput(f"--{name.replace('_', '-')} must be >= {low}")
        if self.data_tokens < self.batch * self.seq_len:
            raise BadInput("--data-tokens must hold at least one batch (batch x seq-len tokens)")
        if self.heldout_tokens < self.seq_len:
            raise BadInput("--heldout-tokens must hold at least one sequence (seq-len tokens)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise BadInput("--lr must be a positive number")
        if min(self.warmup, self.eval_every, self.save_every, self.seed) < 0:
            raise BadInput("--warmup, --eval-every, --save-every and --seed must be >= 0")


# ---------------------------------------------------------------- data


def stdlib_files() -> list[Path]:
    """The Python standard library's own .py files (every machine has them), tests and
    site-packages left out, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def data_files(data: str | Path) -> list[Path]:
    """The text files behind --data: "stdlib", one file, or every file under a directory."""
    if str(data) == "stdlib":
        return stdlib_files()
    path = Path(data).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    raise BadInput(f"no such data: {data} (a file, a directory, or 'stdlib')")


def _held_out(path: Path) -> bool:
    # A fixed tenth of the files, by name, so the held-out text is never trained on.
    return hashlib.sha1(path.name.encode()).digest()[0] % 10 == 0


def _pack(files: list[Path], tokenizer: Any, tokens: int, seq_len: int) -> np.ndarray:
    """Token ids of the files in order, each ended by EOS, cut into (tokens // seq_len,
    seq_len) rows; only as many files are read as needed."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # binary or unreadable: not training text
        ids += tokenizer.encode(text) + ([eos] if eos is not None else [])
        if len(ids) >= tokens:
            break
    rows = min(tokens, len(ids)) // seq_len
    return np.array(ids[: rows * seq_len], dtype=np.int32).reshape(rows, seq_len)


def read_data(
    data: str | Path, tokenizer: Any, config: DistillConfig
) -> tuple[np.ndarray, np.ndarray]:
    """(train, heldout) token rows of seq_len from the data's files, in a seeded order."""
    files = data_files(data)
    if not files:
        raise BadInput(f"not enough text in {data}: no files")
    order = np.random.default_rng(config.seed).permutation(len(files))
    files = [files[i] for i in order]
    if len(files) == 1:  # one file: its last rows are held out
        n_held = -(-config.heldout_tokens // config.seq_len)
        both = _pack(files, tokenizer, config.data_tokens + n_held * config.seq_len, config.seq_len)
        rows, held = both[:-n_held], both[-n_held:]
    else:
        out = {p for p in files if _held_out(p)}
        if len(out) in (0, len(files)):
            out = {files[-1]}
        train = [p for p in files if p not in out]
        rows = _pack(train, tokenizer, config.data_tokens, config.seq_len)
        held = _pack(
            [p for p in files if p in out], tokenizer, config.heldout_tokens, config.seq_len
        )
    if len(rows) < config.batch or len(held) == 0:
        raise BadInput(
            f"not enough text in {data}: {len(rows) * config.seq_len} training and "
            f"{len(held) * config.seq_len} held-out tokens for batch x seq-len = "
            f"{config.batch * config.seq_len}"
        )
    return rows, held


# ---------------------------------------------------------------- the target's labels


def top_logprobs(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The k largest log-probabilities of each row, (..., k) int32 ids and float32 values,
    normalised over the whole vocabulary (so their sum is the top-k's mass, <= 1)."""
    logits = logits.astype(mx.float32)
    idx = mx.argpartition(-logits, k - 1, axis=-1)[..., :k].astype(mx.int32)
    logp = mx.take_along_axis(logits, idx, axis=-1) - mx.logsumexp(logits, -1, keepdims=True)
    return idx, logp


FEATURES_DTYPE = mx.bfloat16  # a target's features as kept: float32's range (residual
# streams reach 1e4, past float16's comfort) in half the bytes


def teacher_pass(teacher: nn.Module, x: mx.array, tap: HiddenTap | None):
    """The teacher's logits on x (B, L) and, with a tap, its features there (B, L, F) in
    FEATURES_DTYPE (None without one): one pass gives both."""
    if tap is None:
        return teacher(x), None
    with tap:
        logits = teacher(x)
    return logits, tap.features().astype(FEATURES_DTYPE)


def label(
    teacher: nn.Module, rows: np.ndarray, k: int, batch: int, reads: tuple = ()
) -> Iterator[tuple[int, dict[str, mx.array]]]:
    """The teacher's top-k at every position of rows (N, L), batch rows a pass: yields
    (rows done, {"idx": (n, L, k), "logp": (n, L, k)}) per pass, with "feats" (n, L, F): its
    hidden states at ``reads`` (hidden.HiddenTap's places) side by side, when it names any."""
    tap = HiddenTap(teacher, reads) if reads else None
    for start in range(0, len(rows), batch):
        logits, feats = teacher_pass(teacher, mx.array(rows[start : start + batch]), tap)
        idx, logp = top_logprobs(logits, k)
        out = {"idx": idx, "logp": logp, **({"feats": feats} if feats is not None else {})}
        mx.eval(out)
        yield min(start + batch, len(rows)), out


def features(
    teacher: nn.Module, rows: np.ndarray, batch: int, reads: tuple
) -> Iterator[tuple[int, mx.array]]:
    """The teacher's features at ``reads`` on rows (N, L), batch rows a pass: yields (rows
    done, feats (n, L, F)) per pass (for rows labelled elsewhere, as on-policy ones are)."""
    tap = HiddenTap(teacher, reads)
    for start in range(0, len(rows), batch):
        _, feats = teacher_pass(teacher, mx.array(rows[start : start + batch]), tap)
        mx.eval(feats)
        yield min(start + batch, len(rows)), feats


def sample_rows(
    teacher: nn.Module, rows: np.ndarray, k: int, batch: int, seed: int
) -> Iterator[tuple[int, np.ndarray, mx.array, mx.array]]:
    """The teacher's own text (on-policy data, as DistillSpec compares): each row keeps its
    first PROMPT_LEN tokens and the teacher samples the rest at T = 1, batch rows at a time.
    The logits it samples from are its labels, so this costs one incremental pass.
    Yields (rows done, token rows (n, L), idx (n, L, k), logp (n, L, k))."""
    key = mx.random.key(seed)
    length = rows.shape[1]
    for start in range(0, len(rows), batch):
        chunk = mx.array(rows[start : start + batch, :PROMPT_LEN])
        cache = make_prompt_cache(teacher)
        logits = teacher(chunk, cache=cache)  # (n, PROMPT_LEN, V)
        toks, labels = [chunk], [top_logprobs(logits, k)]
        for _ in range(length - PROMPT_LEN):
            key, sub = mx.random.split(key)
            nxt = mx.random.categorical(logits[:, -1].astype(mx.float32), key=sub)[:, None]
            toks.append(nxt.astype(mx.int32))
            logits = teacher(toks[-1], cache=cache)  # (n, 1, V)
            labels.append(top_logprobs(logits, k))
            mx.eval(logits)
        out = mx.concatenate(toks, axis=1)
        idx = mx.concatenate([i for i, _ in labels], axis=1)  # (n, L, k)
        logp = mx.concatenate([lp for _, lp in labels], axis=1)
        mx.eval(out, idx, logp)
        yield min(start + batch, len(rows)), np.array(out), idx, logp


# ---------------------------------------------------------------- the student


def pick_blocks(n: int, layers: int, init: str) -> list[int]:
    """Which of the target's n blocks seed the student's: evenly spaced with the first and
    last included ("spaced"), the first `layers` ("first"); "random" picks the spaced ones
    for their shapes only."""
    if init == "first":
        return list(range(layers))
    if layers == 1:
        return [n - 1]
    return [round(i * (n - 1) / (layers - 1)) for i in range(layers)]


def _is_quantized(model: nn.Module) -> bool:
    return any(k.endswith(".scales") for k, _ in tree_flatten(model.parameters()))


def student_config(config: dict, picks: list[int]) -> dict:
    """The target's config cut to the picked blocks: num_hidden_layers, and every per-block
    list (layer_types, per-layer window sizes) taken at the picks."""
    n = config["num_hidden_layers"]
    out = {**config, "num_hidden_layers": len(picks)}
    for key, value in config.items():
        if isinstance(value, list) and len(value) == n and key != "eos_token_id":
            out[key] = [value[i] for i in picks]
    return out


def check_target(target: Loaded, config: DistillConfig) -> int:
    """What every run asks of its target (BadInput otherwise): a depth (a head reads a
    multimodal checkpoint's text model; a student is cut from a top-level one), a top-k
    within its vocabulary, float weights; the settings checked against its depth. Returns
    its depth."""
    n = target.config.get("num_hidden_layers")
    if n is None and config.head:
        n = (target.config.get("text_config") or {}).get("num_hidden_layers")
    if not isinstance(n, int):
        raise BadInput(
            f"{target.spec.alias}: its config has no top-level num_hidden_layers "
            "(a multimodal checkpoint?): distill its text model instead"
        )
    config.check(n)
    if target.vocab_size and config.top_k > target.vocab_size:
        raise BadInput(f"--top-k must be <= the vocabulary ({target.vocab_size})")
    if _is_quantized(target.model):
        raise BadInput(
            f"{target.spec.alias} is quantized: distill from its float weights (what is "
            "trained is float32)"
        )
    return n


def make_student(target: Loaded, config: DistillConfig) -> tuple[nn.Module, dict, list[int]]:
    """The student model (float32, only its blocks and final norm trainable), its config and
    the target blocks it started from. Raises BadInput for targets it cannot cut down."""
    tconfig = target.config
    n = check_target(target, config)
    picks = pick_blocks(n, config.layers, config.init)
    sconfig = student_config(tconfig, picks)
    module = importlib.import_module(type(target.model).__module__)
    mx.random.seed(config.seed)
    student = module.Model(module.ModelArgs.from_dict(sconfig))
    where = {src: dst for dst, src in enumerate(picks)}
    weights = {}
    for key, value in tree_flatten(target.model.parameters()):
        m = _LAYER.search(key)
        if m is None:
            weights[key] = value  # embeddings, final norm, head: the target's own
        elif config.init != "random" and int(m[2]) in where:
            new = f"{m[1]}layers.{where[int(m[2])]}."
            weights[key[: m.start()] + new + key[m.end() :]] = value
    if hasattr(student, "sanitize"):
        weights = student.sanitize(weights)  # e.g. drops a tied model's spare lm_head
    mine = dict(tree_flatten(student.parameters()))
    cant = f"{target.spec.alias}: cannot cut its blocks down to {config.layers}"
    missing = [k for k in weights if k not in mine or mine[k].shape != weights[k].shape]
    missing += [k for k in mine if not _LAYER.search(k) and k not in weights]
    if missing:
        raise BadInput(f"{cant} ({missing[0]} does not fit the smaller model)")
    student.load_weights(list(weights.items()), strict=False)
    theirs, ours = getattr(target.model, "layers", None), getattr(student, "layers", None)
    for i, block in enumerate(picks if theirs is not None and ours is not None else []):
        if _kind(theirs[block]) != _kind(ours[i]):
            raise BadInput(
                f"{cant}: its block {block} would run as another kind of block (a window or "
                "attention pattern set by position): try other --layers or --init first"
            )
    try:
        mx.eval(student(mx.array([[0, 1]])))
    except Exception as e:  # noqa: BLE001 - a family whose forward needs what we cut
        raise BadInput(f"{cant}: the cut model does not run ({type(e).__name__}: {e})") from None
    student.set_dtype(mx.float32)
    student.freeze()
    for name, module_ in student.named_modules():
        # the blocks, and the final norm (the one norm outside them) learn; the embeddings
        # and head stay the target's, so the student reads and writes the same tokens
        last = name.rsplit(".", 1)[-1]
        if re.search(r"(^|\.)layers\.\d+$", name) or ("layers." not in name and last == "norm"):
            module_.unfreeze()
    mx.eval(student.parameters())
    return student, sconfig, picks


def _kind(block: nn.Module) -> list:
    """What makes a block the kind it is apart from its weights: its class and every plain
    setting of it and its parts (window, RoPE base, sliding or not), position ids left out."""
    out = []
    for name, module in block.named_modules():
        out.append((name, type(module).__name__))
        for key, value in vars(module).items():
            skip = key.startswith("_") or re.search(r"idx|index|layer_id|layer_num", key)
            if not skip and isinstance(value, (bool, int, float, str)):
                out.append((name, key, value))
    return sorted(out, key=str)


def trainable(student: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(student.trainable_parameters()))


@dataclass
class Trainee:
    """What a run trains, and how (train.py runs it): a student model here, a head in
    heads.py.

    model: what the steps train (its trainable parameters); reads: the target places its
    features are read at (hidden.HiddenTap's; () for a student); loss: a step's loss on a
    batch of the labels' arrays ("rows", "idx", "logp", "feats" where read, and what
    ``extra`` adds); estimate: the held-out estimates from {"rows", "p", "feats"}; extra:
    per-step arrays drawn from (seed, step) alone (DFlash's anchors); save: write the
    finished model's files into a directory; facts: what distill.json says of it."""

    model: nn.Module
    reads: tuple
    loss: Callable[[dict[str, mx.array]], mx.array]
    estimate: Callable[[dict[str, mx.array]], dict[str, float]]
    save: Callable[[Path], None]
    facts: dict
    extra: Callable[[int, int], dict[str, mx.array]] = lambda step, batch: {}


def student_trainee(target: Loaded, config: DistillConfig) -> Trainee:
    """A student cut from the target (make_student) as a run's trainee. BadInput as there."""
    from mlx_lm.utils import save_config, save_model

    student, sconfig, picks = make_student(target, config)
    loss_fn = LOSS[config.loss]

    def save(out: Path) -> None:
        save_model(out, student)
        save_config(dict(sconfig), out / "config.json")
        target.tokenizer.save_pretrained(str(out))

    return Trainee(
        model=student,
        reads=(),
        loss=lambda b: loss_fn(student(b["rows"]).astype(mx.float32), b["idx"], b["logp"]),
        estimate=lambda h: estimate(student, h["rows"], h["p"]),
        save=save,
        facts={
            "kind": "student",
            "picks": picks,
            "student_params": sum(v.size for _, v in tree_flatten(student.parameters())),
            "trained_params": sum(v.size for v in trainable(student).values()),
        },
    )


# ---------------------------------------------------------------- losses and estimates


def _masked_mean(x: mx.array, valid: mx.array | None) -> mx.array:
    # the mean of x (B, L) over the positions ``valid`` (broadcastable to x) marks
    if valid is None:
        return mx.mean(x)
    valid = mx.broadcast_to(valid, x.shape).astype(x.dtype)
    return mx.sum(x * valid) / mx.maximum(mx.sum(valid), 1)


def kl_loss(
    logits: mx.array, idx: mx.array, logp: mx.array, keep: mx.array | None = None,
    valid: mx.array | None = None,
) -> mx.array:  # fmt: skip
    """Forward KL(p || q) at T = 1 (DistillSpec's FKL) over the partition {each of the
    teacher's top-k ids, all the rest}: sum_i p_i log(p_i / q_i) + p_rest log(p_rest /
    q_rest), mean over positions. A lower bound on KL(p || q), exact when p's mass is in its
    top-k; the rest term keeps the student from parking mass on ids the teacher never keeps.
    logits (B, L, V) the student's; idx, logp (B, L, k) the teacher's top-k: their columns of
    logits and log-probs; keep (B, L, k): which of them the student has a column for (a head
    with a narrower vocabulary: the others join the rest; None: all); valid (B, L): the
    positions averaged over (None: all)."""
    lq = logits - mx.logsumexp(logits, -1, keepdims=True)  # (B, L, V)
    lq_k = mx.take_along_axis(lq, idx, axis=-1)  # (B, L, k)
    p_k = mx.exp(logp)
    if keep is not None:
        p_k, lq_k = mx.where(keep, p_k, 0.0), mx.where(keep, lq_k, 0.0)
    q_k = mx.exp(lq_k) if keep is None else mx.where(keep, mx.exp(lq_k), 0.0)
    p_rest = mx.maximum(1 - mx.sum(p_k, -1), 0.0)  # (B, L)
    q_rest = mx.maximum(1 - mx.sum(q_k, -1), 1e-12)
    rest = p_rest * (mx.log(mx.maximum(p_rest, 1e-12)) - mx.log(q_rest))
    return _masked_mean(mx.sum(p_k * (logp - lq_k), -1) + rest, valid)


def tvd_loss(
    logits: mx.array, idx: mx.array, logp: mx.array, keep: mx.array | None = None,
    valid: mx.array | None = None,
) -> mx.array:  # fmt: skip
    """Total variation between p and q over the partition {each top-k id, all the rest}:
    1/2 (sum_i |p_i - q_i| + |p_rest - q_rest|), a lower bound on TVD(p, q) that is exact
    when p's mass is in its top-k. 1 - TVD is the acceptance rate at T = 1, which is why
    DistillSpec tries it. Arguments as kl_loss."""
    lq = logits - mx.logsumexp(logits, -1, keepdims=True)
    q_k, p_k = mx.exp(mx.take_along_axis(lq, idx, axis=-1)), mx.exp(logp)
    if keep is not None:
        q_k, p_k = mx.where(keep, q_k, 0.0), mx.where(keep, p_k, 0.0)
    rest = mx.abs(mx.sum(q_k, -1) - mx.sum(p_k, -1))  # |p_rest - q_rest|
    return _masked_mean(0.5 * (mx.sum(mx.abs(p_k - q_k), -1) + rest), valid)


LOSS = {"kl": kl_loss, "tvd": tvd_loss}


def estimate(student: nn.Module, heldout: mx.array, p: mx.array) -> dict[str, float]:
    """Held-out estimates of what the pair will accept: greedy agreement (argmax q ==
    argmax p), alpha = E[sum_x min(p, q)] (the acceptance rate at T = 1) and KL(p || q).
    heldout (H, L) ids; p (H, L, V) the teacher's probabilities there."""
    logits = student(heldout).astype(mx.float32)
    lq = logits - mx.logsumexp(logits, -1, keepdims=True)
    q = mx.exp(lq)
    p = p.astype(mx.float32)
    agree = mx.mean(mx.argmax(q, -1) == mx.argmax(p, -1))
    alpha = mx.mean(mx.sum(mx.minimum(p, q), -1))
    kl = mx.mean(mx.sum(p * (mx.log(mx.maximum(p, 1e-30)) - lq), -1))
    return {"greedy": agree.item(), "alpha": alpha.item(), "kl": kl.item()}


def teacher_probs(
    teacher: nn.Module, heldout: mx.array, batch: int, reads: tuple = ()
) -> tuple[mx.array, mx.array | None]:
    """The teacher's full next-token probabilities on the held-out rows, float16 (H, L, V),
    and its features at ``reads`` there (H, L, F) (None when it names none)."""
    tap = HiddenTap(teacher, reads) if reads else None
    parts, feats = [], []
    for start in range(0, heldout.shape[0], batch):
        logits, f = teacher_pass(teacher, heldout[start : start + batch], tap)
        parts.append(mx.softmax(logits.astype(mx.float32), -1).astype(mx.float16))
        feats += [f] if f is not None else []
        mx.eval(parts[-1], feats)  # a chunk at a time: the (H, L, V) float32 logits never all exist
    return mx.concatenate(parts), (mx.concatenate(feats) if feats else None)
