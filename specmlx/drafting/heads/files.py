"""A head checkpoint's directory as its authors publish it: config.json and safetensors.

Shared by the head kinds that ship as their own directory (eagle3.py, dflash.py): reading the
config and the decoder-layer shape it gives, the tensor names from the headers alone (for the
checks made before anything loads), the tensors, their bytes on disk and the dtype the head
takes from its target."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...errors import BadInput, ModelLoadError

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


def text_config(config: dict) -> dict:
    """The text model's part of a config.json (a multimodal one keeps it under text_config)."""
    return config.get("text_config") or config


def rope_kind(scaling: dict | None) -> str | None:
    """The kind of a config's ``rope_scaling`` (its rope_type, or the older name type)."""
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type")


def check_architecture(config: dict, mark: str, where, kind: str, says: str) -> None:
    """BadInput unless an architecture a head's config.json names contains ``mark`` (in any
    case). where: names the head; kind: what it should be ("a DFlash drafter"); says: what
    such heads name ("DFlash drafters say DFlashDraftModel")."""
    arch = " ".join(config.get("architectures") or [])
    if mark not in arch.lower():
        raise BadInput(
            f"{where} is not {kind} (its config's architectures are {arch or 'missing'}; {says})"
        )


def layer_shape(config: dict) -> dict:
    """A head's decoder-layer shape from its config.json (transformers' Llama and Qwen3 names),
    by the field names of Eagle3Config and DFlashConfig: hidden, heads, kv_heads, head_dim,
    intermediate, eps, rope_theta, rope_scaling, max_positions. KeyError, TypeError or
    ValueError where one is missing or garbled."""
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return dict(
        hidden=hidden,
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        intermediate=int(config["intermediate_size"]),
        eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        rope_scaling=config.get("rope_scaling"),
        max_positions=int(config.get("max_position_embeddings") or 2048),
    )


def check_layer_kind(config: dict, where, kind: str) -> None:
    """BadInput where a head's config.json asks for what its layers do not run: a RoPE
    scaling outside ROPES, an activation other than silu. where: names the head; kind: what
    the error says uses silu ("EAGLE-3 heads")."""
    scaling = config.get("rope_scaling")
    rope = rope_kind(scaling)
    if scaling is not None and rope not in ROPES:
        raise BadInput(f"{where}: rope scaling {rope!r} is not supported (known: {ROPES})")
    if config.get("hidden_act", "silu") != "silu":
        raise BadInput(f"{where}: activation {config['hidden_act']!r} ({kind} use silu)")


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
