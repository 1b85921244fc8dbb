"""The quantize-at-load cache: where a model's quantized copy lives (keyed by its full
identity), whether an earlier load made it, and making it once with mlx-lm."""

from __future__ import annotations

import contextlib
import hashlib
import io
import re
import shutil
import time
from pathlib import Path

import mlx.nn as nn

from ..paths import load_json, specmlx_home
from .registry import ModelSpec
from .sources import Progress, file_facts, local_files, say


def quantized_dir(spec: ModelSpec) -> Path:
    """Where the quantize-at-load copy of ``spec`` lives: named by alias, keyed by identity."""
    name = re.sub(r"[^\w.-]", "_", spec.alias)
    key = hashlib.sha1(spec.identity.encode()).hexdigest()[:10]
    return specmlx_home() / "quantized" / f"{name}-{key}"


def cached_quantized(spec: ModelSpec) -> Path | None:
    """The quantized copy from an earlier load, if it was made for this very identity and
    from the source's files as they are now (a replaced GGUF or checkpoint at the same path
    is quantized again; a source no longer on disk leaves the copy in use)."""
    cache = quantized_dir(spec)
    if not any(cache.glob("model*.safetensors")):
        return None
    config = load_json(cache / "config.json") or {}
    if config.get("specmlx_spec") != spec.identity:
        return None
    src = local_files(spec)
    present = src is not None and (src.is_file() or any(src.glob("*.safetensors")))
    if present and config.get("specmlx_identity") != f"{spec.identity}|{file_facts(src)}":
        return None
    return cache


def quantize_and_cache(
    spec: ModelSpec, src: Path, loaded: tuple, progress: Progress | None
) -> tuple[nn.Module, object, dict, str]:
    """Quantize a model loaded from ``src`` once with mlx-lm and save it under
    $SPECMLX_HOME/quantized (keyed by the spec's identity) so later loads skip the work.

    spec: the model (its ``quantize`` set); src: the directory it was loaded from (the
    tokenizer files are copied from there); loaded: (model, tokenizer, config) as loaded;
    progress: gets a line before the work. Returns (model, tokenizer, config, identity)."""
    from mlx_lm.utils import quantize_model, save

    model, tokenizer, config = loaded
    identity = f"{spec.identity}|{file_facts(src)}"
    if "quantization" in config:  # already quantized on disk: use it as it is
        return model, tokenizer, config, identity
    q, cache = spec.quantize, quantized_dir(spec)
    say(progress, f"quantizing {spec.alias} to {q.bits} bits (group {q.group_size}) into {cache}")
    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight: not ours
        model, config = quantize_model(model, config, q.group_size, q.bits)
    config["specmlx_spec"], config["specmlx_identity"] = spec.identity, identity
    tmp = cache.with_name(f".{cache.name}.tmp{time.monotonic_ns()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save(tmp, src, model, tokenizer, config, donate_model=False)
        shutil.rmtree(cache, ignore_errors=True)
        tmp.rename(cache)  # atomic: a crash never leaves a half-written cache behind
    except OSError as e:  # a read-only home: this run is quantized all the same
        shutil.rmtree(tmp, ignore_errors=True)
        say(progress, f"could not cache the quantized copy in {cache} ({e.strerror or e})")
    return model, tokenizer, config, identity
