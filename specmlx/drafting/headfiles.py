"""A head checkpoint's directory as its authors publish it: config.json and safetensors.

Shared by the head kinds that ship as their own directory (eagle3.py, dflash.py): reading the
config, the tensor names from the headers alone (for the checks made before anything loads),
the tensors, their bytes on disk and the dtype the head takes from its target."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import ModelLoadError

# rope scalings mlx-lm's initialize_rope computes as the head kinds' references
# (transformers, EAGLE's cnets.py) do
ROPES = ("linear", "llama3", "yarn", "default")


def read_head_config(path: Path, kind: str = "a head") -> dict:
    """A head directory's config.json (ModelLoadError naming what is wrong).

    path: the head's directory; kind: what the error calls the head ("an EAGLE-3 head")."""
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} has no config.json ({kind} needs one)") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from None


def tensor_names(path: Path) -> set[str]:
    """The tensor names in a directory's safetensors, from their headers (nothing loaded)."""
    names: set[str] = set()
    for f in sorted(path.glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                names |= set(json.loads(fh.read(size))) - {"__metadata__"}
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from None
    return names


def head_weights(path: Path) -> dict[str, mx.array]:
    """Every tensor in a head directory's safetensors, by name (lazy: mx.load maps them)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = [p.name for p in path.glob("*.bin")]
        raise ModelLoadError(
            f"{path} has no .safetensors"
            + (f" (only {', '.join(bins)}: convert it to safetensors first)" if bins else "")
        )
    out: dict[str, mx.array] = {}
    for f in files:
        try:
            out.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise ModelLoadError(f"cannot read {f}: {str(e).splitlines()[0]}") from None
    return out


def head_nbytes(path: Path) -> int:
    """Bytes of a head's tensors on disk (what the memory plan counts for it)."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def target_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of a model's floating parameters (a head runs in its target's)."""
    leaves = tree_flatten(model.parameters())
    return next(v.dtype for _, v in leaves if mx.issubdtype(v.dtype, mx.floating))
