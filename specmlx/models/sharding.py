"""Splitting a target over ranks (tensor parallelism, mlx-lm's ``shard``): whether a model can
be split, and which of its tensors each rank holds a share of. Decided from the config and
the tensor names alone, before anything loads."""

from __future__ import annotations

import re

from ..core.mlx_lm_api import model_classes
from ..errors import BadInput

# the layers tensor parallelism splits (mlx-lm's shard(): attention and MLP projections);
# embeddings, the head and the norms stay whole on every rank
SHARDED = re.compile(
    r"(?:layers|blk)\.\d+\..*(?:_proj|attn_[qkv]\b|attn_output|ffn_(?:gate|up|down))"
)


def shard_support(config: dict) -> bool:
    """Whether mlx-lm implements tensor parallelism (a ``shard`` method) for this config's
    architecture; decided from the class alone, without loading anything."""
    try:
        model_class, _ = model_classes(config)
    except (ValueError, KeyError):
        return False
    return hasattr(model_class, "shard")


def check_shardable(config: dict, size: int, name: str, has_shard: bool) -> None:
    """BadInput before anything loads when ``size`` ranks cannot split this model: mlx-lm
    must implement tensor parallelism for it, and its heads and MLP must divide evenly."""
    if not has_shard:
        raise BadInput(
            f"{name} ({config.get('model_type', '?')}) has no tensor-parallel sharding in "
            "mlx-lm, so it cannot be split over ranks"
        )
    c = config.get("text_config", config)
    heads, kv = c.get("num_attention_heads"), c.get("num_key_value_heads")
    kv = kv or heads
    for what, n in (("attention heads", heads), ("KV heads", kv), ("MLP units", c.get("intermediate_size"))):  # fmt: skip
        if n is not None and n % size:
            raise BadInput(
                f"{name} has {heads} query / {kv} KV heads and {c.get('intermediate_size')} "
                f"MLP units: its {what} ({n}) do not split evenly over {size} ranks"
            )
