"""A CPU stand-in pair built from one real model: a wider twin target and a 4-bit draft.

On CPU, MLX is only fast in float32, so a cheaper draft has to have fewer parameters. With
one real model offline, we make the *target* bigger instead: zero-padding widens it m times
without changing its logits (at about m**2 the cost). The draft is the base with its block
weights rounded to 4 bits and run in float32, so it sometimes disagrees with the target.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.llama import Model, ModelArgs

from ..errors import SpecmlxError
from ..models.loading import load_model
from ..models.registry import load_registry
from ..models.sources import Progress, say
from ..paths import atomic_write, specmlx_home

Weights = dict[str, mx.array]
TOLERANCE = 1e-3
PROMPTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import numpy as np\n\ndef softmax(x):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "The capital of France is Paris. The capital of Germany is",
)


def widened_args(args: ModelArgs, m: int) -> ModelArgs:
    """The llama args of ``args`` widened m times (hidden, heads, kv heads, MLP units)."""
    if m < 1 or args.model_type != "llama":
        raise ValueError("widen needs a llama model and an integer m >= 1")
    head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
    # The residual stream gains (m-1)*d entries that stay exactly 0, so the RMS over m*d
    # entries is the real RMS / sqrt(m) (eps too, once it is divided by m); norm weights
    # scaled by sqrt(1/m) restore the real dims' values and zero weights keep the rest 0.
    return replace(
        args,
        hidden_size=args.hidden_size * m,
        intermediate_size=args.intermediate_size * m,
        num_attention_heads=args.num_attention_heads * m,
        num_key_value_heads=args.num_key_value_heads * m,
        head_dim=head_dim,
        rms_norm_eps=args.rms_norm_eps / m,
    )


def widen(weights: Weights, args: ModelArgs, m: int) -> tuple[Weights, ModelArgs]:
    """Widen a llama model m times (hidden, heads, kv heads, MLP units); logits are unchanged."""
    wide = widened_args(args, m)
    # Every axis grows at its end: new q heads h >= n_heads map to kv head h // group
    # >= n_kv_heads (the new, all-zero ones), and the old heads keep their kv heads.
    shapes = {k: v.shape for k, v in tree_flatten(Model(wide).parameters())}
    if set(shapes) != set(weights):
        raise ValueError("weights do not match the llama layout of args")
    out = {}
    for k, w in weights.items():
        w = mx.pad(w, [(0, n - s) for s, n in zip(w.shape, shapes[k], strict=True)])
        out[k] = w * (m**-0.5) if k.endswith("norm.weight") else w
    return out, wide


def quantize_dequantize(weights: Weights, bits: int = 4, group_size: int = 64) -> Weights:
    """Round the blocks' linear weights to `bits` (mx.quantize) and back to float32."""
    out = dict(weights)
    for k, w in weights.items():
        if ".layers." in k and k.endswith("_proj.weight") and w.ndim == 2:
            q = mx.quantize(w, group_size=group_size, bits=bits)
            out[k] = mx.dequantize(*q, group_size=group_size, bits=bits).astype(mx.float32)
    return out


def _save(path: Path, weights: Weights, args: ModelArgs, tokenizer: Any) -> None:
    from mlx_lm.utils import save_config, save_model

    model = Model(args)
    model.load_weights(list(weights.items()))  # strict: catches any shape slip
    save_model(path, model)
    config = {**asdict(args), "eos_token_id": tokenizer.eos_token_id}
    save_config(config, path / "config.json")
    tokenizer.save_pretrained(str(path))


def _greedy(model: Any, ids: list[int], n: int) -> list[int]:
    cache, out, x = make_prompt_cache(model), [], mx.array([ids])
    for _ in range(n):
        tok = int(mx.argmax(model(x, cache=cache)[0, -1]).item())
        out.append(tok)
        x = mx.array([[tok]])
    return out


def is_complete(out_dir: Path) -> bool:
    """True when a pair was fully built (pair.json is written last)."""
    return (out_dir / "pair.json").is_file()


def build_cpu_pair(
    base_model: Any,
    base_tokenizer: Any,
    out_dir: str | Path,
    m: int = 3,
    bits: int = 4,
    group_size: int = 64,
    prompts: tuple[str, ...] = PROMPTS,
    continuation: int = 24,
) -> dict[str, Any]:
    """Write float32 out_dir/target and out_dir/draft, check them reloaded, return the facts.

    Raises SpecmlxError when the reloaded target's logits differ from the base's by
    TOLERANCE or more; pair.json (the completion mark) is then not written.
    """
    from mlx_lm import load

    out = Path(out_dir).expanduser()
    args = base_model.args
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(base_model.parameters())}
    n_params = sum(w.size for w in weights.values())
    _save(out / "draft", quantize_dequantize(weights, bits, group_size), args, base_tokenizer)
    wide, wide_args = widen(weights, args, m)
    _save(out / "target", wide, wide_args, base_tokenizer)
    del wide
    target, _ = load(str(out / "target"))
    draft, _ = load(str(out / "draft"))
    wide_params = sum(v.size for _, v in tree_flatten(target.parameters()))
    max_delta, agree, follow, total = 0.0, 0, 0, 0
    for text in prompts:
        ids = base_tokenizer.encode(text)
        seq = mx.array([ids + _greedy(base_model, ids, continuation)])
        lb, lt, ld = base_model(seq), target(seq), draft(seq)
        max_delta = max(max_delta, mx.max(mx.abs(lt - lb)).item())
        # Score the continuation positions: the target's greedy pick vs the draft's.
        pt = mx.argmax(lt[0, len(ids) - 1 : -1], axis=-1)
        agree += mx.sum(pt == mx.argmax(ld[0, len(ids) - 1 : -1], axis=-1)).item()
        follow += mx.sum(pt == seq[0, len(ids) :]).item()
        total += continuation
    facts = {
        "m": m,
        "bits": bits,
        "group_size": group_size,
        "base_params": n_params,
        "target_params": wide_params,
        "draft_params": n_params,
        "max_abs_dlogit": max_delta,
        "tokens_checked": total,
        "target_follows_base": follow / total,
        "draft_agreement": agree / total,
        "target": str(out / "target"),
        "draft": str(out / "draft"),
        "labels": {
            "target": f"stand-in: base widened {m}x with zero weights, same logits, "
            f"{wide_params / n_params:.1f}x the parameters",
            "draft": f"stand-in: base with block weights {bits}-bit g{group_size} "
            "quantized then dequantized to float32",
        },
    }
    if not max_delta < TOLERANCE:
        raise SpecmlxError(f"widened target differs from base: max |dlogit| {max_delta:.2e}")
    atomic_write(out / "pair.json", json.dumps(facts, indent=2) + "\n")  # the completion mark
    return facts


def build_useless_draft(tokenizer: Any, vocab: int, out_dir: Path) -> None:
    """A random-weight 2-layer draft with the real tokenizer: it never agrees with anything,
    which is what checks that adaptive k stops paying for a draft that does not help."""
    args = ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
        rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=8192,
    )  # fmt: skip
    mx.random.seed(0)
    model = Model(args)
    _save(out_dir, dict(tree_flatten(model.parameters())), args, tokenizer)


def demo_dir() -> Path:
    """Where `specmlx models build cpu-demo` puts the pair ($SPECMLX_HOME/cpu-demo)."""
    return specmlx_home() / "cpu-demo"


def build_demo(
    out: Path | None = None,
    *,
    force: bool = False,
    m: int = 3,
    bits: int = 4,
    group_size: int = 64,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Build the CPU demo pair (and the useless draft) from smollm2-135m, unless it is built.

    out: the directory (default demo_dir()); force: rebuild even if complete; m, bits,
    group_size: see build_cpu_pair; progress: gets a line before slow steps.
    Returns the pair's facts (pair.json) with "built": False when it was already there."""
    out = (out or demo_dir()).expanduser()
    if is_complete(out) and not force:
        if not (out / "useless-draft" / "config.json").exists():
            from mlx_lm.utils import load_tokenizer

            tokenizer = load_tokenizer(out / "draft")
            vocab = json.loads((out / "draft" / "config.json").read_text())["vocab_size"]
            build_useless_draft(tokenizer, vocab, out / "useless-draft")
        return {**json.loads((out / "pair.json").read_text()), **_sizes(out), "built": False}
    shutil.rmtree(out, ignore_errors=True)
    base = load_model(load_registry().resolve("smollm2-135m"), progress=progress)
    base.model.set_dtype(mx.float32)  # the check compares float32 against float32
    # float32 on disk: the widened target (shapes only: nothing is computed) and the draft
    wide = sum(
        v.size for _, v in tree_flatten(Model(widened_args(base.model.args, m)).parameters())
    )
    size = 4 * (wide + base.nbytes // 4)
    say(progress, f"building {out} (about {size / 1e9:.1f} GB; widening, quantizing, then "
        "checking logits: a minute or two on a CPU)")  # fmt: skip
    facts = build_cpu_pair(base.model, base.tokenizer, out, m, bits, group_size)
    build_useless_draft(base.tokenizer, base.vocab_size, out / "useless-draft")
    return {**facts, **_sizes(out), "built": True}


def _sizes(out: Path) -> dict[str, int]:
    return {
        f"{role}_bytes": sum(f.stat().st_size for f in (out / role).glob("*.safetensors"))
        for role in ("target", "draft")
    }


def describe(facts: dict[str, Any]) -> list[str]:
    """What a built pair is, in lines for the CLI."""
    lines = []
    for role in ("target", "draft"):
        size = facts.get(f"{role}_bytes")
        shown = f", {size / 2**30:.2f} GiB float32" if size else ""
        lines.append(
            f"{role}: {facts[role]}  {facts[role + '_params'] / 1e6:.0f}M params{shown}\n"
            f"  {facts['labels'][role]}"
        )
    lines.append(
        f"check: max |dlogit| target vs base {facts['max_abs_dlogit']:.1e} (< {TOLERANCE:g}) "
        f"on {len(PROMPTS)} prompts; the draft agrees with the target's greedy pick on "
        f"{facts['draft_agreement']:.0%} of {facts['tokens_checked']} continuation tokens"
    )
    return lines
