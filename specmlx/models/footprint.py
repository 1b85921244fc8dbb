"""Memory planning before anything loads: the weights as they will be loaded plus both KV
caches for the planned context, against what the device can use.

Pure sizing over what inspection.py reads: sizes come from the tensor headers where they can
be read without the weights (safetensors headers of local files and of hub repos, GGUF
headers), and from the llama formula over config.json as the fallback.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

from ..core.caches import ROLLBACK_SLACK, WindowKVCache
from ..errors import BadInput, DoesNotFit, ModelLoadError, SpecmlxError
from .gguf import MX_QUANTIZED
from .inspection import Tensors, peek, resolve_dtype
from .quantized import cached_quantized
from .registry import ModelSpec
from .sharding import SHARDED
from .sources import Progress

WINDOW_STEP = WindowKVCache.step  # a window cache allocates this many tokens ahead
_FLOATS = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_INTS = {"U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8, "BOOL": 1}


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
    shards: int = 1  # ranks the target is split over: the numbers are per rank


def parse_size(text: str) -> int:
    """Bytes from '123', '8GB', '8 GiB', '512M' (decimal units unless 'iB')."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*([kmgt]?)(i?)b?\s*", text.lower())
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


# ---------------------------------------------------------------- reading sizes


def tensor_bytes(tensors: Tensors, spec: ModelSpec, dtype_bytes: int, shards: int = 1) -> int:
    """Bytes of the weights as loaded: floats cast to the spec's dtype (or quantized at load,
    for 2-D weights whose rows split into groups), packed integers as stored, GGUF Q4_0/Q4_1/
    Q8_0 kept quantized with ``keep_quantized`` (else dequantized). With ``shards`` ranks,
    each holds 1/shards of the attention and MLP projections and all of the rest."""
    q = spec.quantize
    packed = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".scales")}
    total = 0
    for name, (kind, shape) in tensors.items():
        n = math.prod(shape)
        if kind in MX_QUANTIZED and spec.keep_quantized:
            size = n * MX_QUANTIZED[kind] // 8 + n // 32 * 2 * dtype_bytes
        elif kind in _INTS:
            size = n * _INTS[kind]
        elif (
            q
            and name.endswith(".weight")
            and name.rsplit(".", 1)[0] not in packed
            and len(shape) == 2
            and shape[-1] % q.group_size == 0
        ):
            size = n * q.bits // 8 + n // q.group_size * 2 * dtype_bytes
        else:
            size = n * dtype_bytes
        total += size // shards if shards > 1 and SHARDED.search(name) else size
    return total


def formula_bytes(config: dict, dtype_bytes: int, shards: int = 1) -> int:
    """Estimated bytes of a llama-like model's weights from its config (KeyError if the
    config lacks a llama field): the fallback when no tensor table can be read. With
    ``shards`` ranks, the per-rank share (the projections split, embeddings whole)."""
    c = config.get("text_config", config)
    h, layers, inter, heads = (
        c["hidden_size"],
        c["num_hidden_layers"],
        c["intermediate_size"],
        c["num_attention_heads"],
    )
    kv, hd = c.get("num_key_value_heads") or heads, c.get("head_dim") or h // heads
    linear = layers * (2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter) // shards
    linear += c["vocab_size"] * h * (1 if c.get("tie_word_embeddings", False) else 2)
    norms = (2 * layers + 1) * h * dtype_bytes
    if q := c.get("quantization") or config.get("quantization"):
        per_weight = q["bits"] / 8 + 2 * dtype_bytes / q["group_size"]
        return int(linear * per_weight) + norms
    return linear * dtype_bytes + norms


def layer_kinds(config: dict) -> list[str]:
    """Each layer's cache as mlx-lm makes it, read from the config: "full" (a KV cache that
    grows with the context), "window" (a sliding window or Llama 4's chunk), "recurrent" (a fixed-size state),
    "both" (Falcon-H1: attention and an SSM in every layer) or "none" (an MLP-only layer)."""
    c = config.get("text_config", config)
    kind = config.get("model_type") or c.get("model_type", "")
    if pattern := c.get("hybrid_override_pattern"):  # Nemotron-H: M mamba, * attention
        return ["recurrent" if p == "M" else "full" if p == "*" else "none" for p in pattern]
    n = c["num_hidden_layers"]
    if types := c.get("layer_types"):
        names = {"sliding_attention": "window", "full_attention": "full", "attention": "full"}
        kinds = [names.get(t, "recurrent") for t in types]
        shared = c.get("num_kv_shared_layers") or 0  # Gemma 3n: read an earlier layer's KV
        return kinds[: n - shared] + ["none"] * shared
    if kind == "llama4" and c.get("attention_chunk_size"):  # chunks on 3 layers of 4
        return ["full" if (i + 1) % 4 == 0 else "window" for i in range(n)]
    if kind in ("mamba", "mamba2", "rwkv7"):
        return ["recurrent"] * n
    if kind == "falcon_h1":
        return ["both"] * n
    if every := c.get("full_attention_interval"):  # Qwen3-Next, Qwen3.5: gated delta between
        return ["full" if (i + 1) % every == 0 else "recurrent" for i in range(n)]
    if (period := c.get("attn_layer_period")) is not None:  # Jamba
        offset = c.get("attn_layer_offset", 0)
        return ["full" if i % period == offset else "recurrent" for i in range(n)]
    if (idxs := c.get("full_attn_idxs")) is not None:  # LFM2: short convolutions between
        return ["full" if i in idxs else "recurrent" for i in range(n)]
    pattern = c.get("sliding_window_pattern")
    if isinstance(pattern, str) and pattern:  # EXAONE 4: "LLLG", L local (a window), G global
        return ["window" if pattern[i % len(pattern)] == "L" else "full" for i in range(n)]
    if kind.startswith(("gemma3", "gemma4", "cohere2")) and (
        c.get("sliding_window") or kind != "cohere2"
    ):
        every = pattern or (5 if kind.startswith("gemma4") else 6)
        kinds = ["full" if (i + 1) % every == 0 else "window" for i in range(n)]
        shared = c.get("num_kv_shared_layers") or 0  # Gemma 4: read an earlier layer's KV
        return kinds[: n - shared] + ["none"] * shared
    return ["full"] * n


def recurrent_state_bytes(config: dict, dtype_bytes: int) -> int:
    """Bytes of one recurrent layer's state: the convolution's last inputs (in the model's
    dtype) and the SSM or gated-delta state (float32), from the family's config fields;
    an unknown family counts a generous 4 x hidden^2 bytes."""
    c = config.get("text_config", config)
    h = c["hidden_size"]
    if "linear_num_value_heads" in c:  # gated delta (Qwen3-Next, Qwen3.5)
        nv, nk = c["linear_num_value_heads"], c["linear_num_key_heads"]
        dv, dk = c["linear_value_head_dim"], c["linear_key_head_dim"]
        conv = (c.get("linear_conv_kernel_dim", 4) - 1) * (2 * nk * dk + nv * dv)
        return conv * dtype_bytes + nv * dv * dk * 4
    heads = c.get("mamba_num_heads") or c.get("mamba_n_heads") or c.get("num_heads")
    state = c.get("ssm_state_size") or c.get("mamba_d_state") or c.get("state_size")
    if heads and state:  # Mamba 2 style (Mamba2, Nemotron-H, Falcon-H1, Granite 4)
        hd = c.get("mamba_head_dim") or c.get("mamba_d_head") or c.get("head_dim")
        groups = c.get("n_groups") or c.get("mamba_n_groups") or 1
        conv = (c.get("conv_kernel") or c.get("mamba_d_conv") or 4) - 1
        return conv * (heads * hd + 2 * groups * state) * dtype_bytes + heads * hd * state * 4
    if state := c.get("mamba_d_state"):  # Mamba 1 style (Jamba)
        inner = c.get("mamba_expand", 2) * h
        return (c.get("mamba_d_conv", 4) - 1) * inner * dtype_bytes + inner * state * 4
    if "conv_L_cache" in c:  # LFM2's short convolution
        return (c["conv_L_cache"] - 1) * h * dtype_bytes
    if "a_low_rank_dim" in c:  # RWKV-7: a (heads, hd, hd) state and two token shifts
        return h * c["head_dim"] * 4 + 2 * h * dtype_bytes
    return 4 * h * h


def kv_bytes(config: dict, context: int, dtype_bytes: int, batched: bool = False) -> int:
    """Cache bytes for ``context`` tokens, layer by layer (layer_kinds): a full-attention
    layer holds K and V for every token (2 x kv_heads x head_dim x context x dtype), a
    sliding-window one for its window plus the rollback slack and one allocation step (a
    batch's row, ``batched``: every token, as core.batch_caches keeps them), a recurrent one a fixed
    state, counted twice (the live state and the one a rollback restores)."""
    c = config.get("text_config", config)
    kinds = layer_kinds(config)
    if all(k in ("recurrent", "none") for k in kinds):
        per_token = 0  # no attention: the head counts below may be absent
    else:
        heads = c["num_attention_heads"]
        kv = c.get("num_key_value_heads") or heads
        hd = c.get("head_dim") or c["hidden_size"] // heads
        per_token = 2 * kv * hd * dtype_bytes
    span = c.get("sliding_window") or c.get("attention_chunk_size") or context  # a window or chunk
    window = context if batched else min(context, span + ROLLBACK_SLACK + WINDOW_STEP)
    total = 0
    for k in kinds:
        if k in ("full", "both"):
            total += per_token * context
        elif k == "window":
            total += per_token * window
        if k in ("recurrent", "both"):
            total += 2 * recurrent_state_bytes(config, dtype_bytes)
    return total


def weight_bytes(spec: ModelSpec, config: dict, tensors: Tensors | None, shards: int = 1) -> int:
    """Bytes of ``spec``'s weights as loaded (per rank with ``shards`` ranks): from the tensor
    table when there is one, else the llama formula (KeyError when the config is not
    llama-like either)."""
    nbytes = resolve_dtype(spec.dtype).size
    if tensors:
        return tensor_bytes(tensors, spec, nbytes, shards)
    return formula_bytes(config, nbytes, shards)


def model_size(spec: ModelSpec) -> int | None:
    """Bytes of a local model as it would load, or None when it cannot be told (for display:
    never raises, never downloads; call it for models that are local)."""
    try:
        config, tensors = peek(spec, local_only=True)
        return weight_bytes(spec, config, tensors)
    except (SpecmlxError, KeyError, TypeError, ValueError, OSError):
        return None


# ---------------------------------------------------------------- the plan


def plan_memory(
    target: ModelSpec,
    draft: ModelSpec | None,
    context: int,
    *,
    target_config: dict | None = None,
    draft_config: dict | None = None,
    reserve: int = 0,
    shards: int = 1,
    batched: bool = False,
    progress: Progress | None = None,
) -> MemoryPlan:
    """Weights plus KV caches for the pair and ``context`` tokens.

    target, draft: the models (draft None: target alone; a quantize-at-load model not cached
    yet counts at full precision, its peak while loading); context: tokens to plan the KV
    caches for; shards: ranks the target is split over (the plan is then per rank: a share of
    the target and of its KV cache, the whole draft); target_config, draft_config: configs
    to size by the llama formula instead of
    peeking at the models (tests, or callers that know them); reserve: bytes kept for more
    KV caches (the server's prompt cache), counted with the KV caches; batched: size the KV
    caches as a batch's row holds them (kv_bytes); progress: download notes."""
    sizes, kv = [], 0
    for spec, config, split in ((target, target_config, shards), (draft, draft_config, 1)):
        if spec is None:
            sizes.append(0)
            continue
        tensors = None
        if config is None:
            config, tensors = peek(spec, progress=progress)
        if spec.quantize and not cached_quantized(spec) and tensors:
            # the first load reads the full-precision weights, then quantizes: plan that peak
            spec = replace(spec, quantize=None)
        nbytes = resolve_dtype(spec.dtype).size
        try:
            sizes.append(weight_bytes(spec, config, tensors, split))
            kv += kv_bytes(config, context, nbytes, batched) // split
        except KeyError as e:  # not a llama-like config: nothing honest to add up
            raise ModelLoadError(f"cannot size {spec.alias} from its config (no {e})") from None
    available, source = available_memory()
    kv += reserve
    total = sizes[0] + sizes[1] + kv
    fits = total <= available
    return MemoryPlan(sizes[0], sizes[1], kv, context, total, available, source, fits, shards)


def gb_text(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def require_fit(plan: MemoryPlan, target: ModelSpec, draft: ModelSpec | None) -> None:
    """Raise DoesNotFit, with the numbers and what to change, when the plan does not fit."""
    if plan.fits:
        return
    share = f" (its share on each of {plan.shards} ranks)" if plan.shards > 1 else ""
    parts = [f"target {target.alias}{share} {gb_text(plan.target_bytes)}"]
    if draft is not None:
        parts.append(f"draft {draft.alias} {gb_text(plan.draft_bytes)}")
    parts.append(f"KV caches for {plan.context} tokens {gb_text(plan.kv_bytes)}")
    raise DoesNotFit(
        f"{' + '.join(parts)} = {gb_text(plan.total_bytes)}, but only {gb_text(plan.available_bytes)} "
        f"is available{' per rank' if plan.shards > 1 else ''} ({plan.available_from}); use "
        "a quantized target (a -q4 alias), more ranks, or a smaller --context or --max-tokens"
    )
