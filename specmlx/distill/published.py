"""A head in the layout its authors publish (`specmlx distill --head eagle3|dflash|mtp`): its
config.json after the target's shapes, checked as the loaders check a downloaded one; the head
made fresh over its target; and the head saved, so that ``load_eagle3`` / ``load_dflash`` /
``load_mtp`` read it back like any downloaded one.

EAGLE-3 is SpecForge's LlamaForCausalLMEagle3: one decoder layer, its own LM head over the
``draft_vocab`` ids the data uses most (SpecForge's d2t), started as the target's rows for
them, and its final norm as the target's. DFlash is z-lab's DFlashDraftModel: decoder layers
of the target's width, its final norm started as the target's. Each embeds with the target's
embedding, frozen (a narrower EAGLE-3 head with it carried into its width), and DFlash and
MTP score with the target's LM head. An MTP head (the Qwen families' one decoder layer of the
family's own kind) is saved in the checkpoint's layout (``mtp.*``), as ``mtp.safetensors`` in
a directory that links the target's own files, so that directory is the target with this
head (``--target DIR --draft mtp``). Nothing here writes to disk but ``save_head`` and
``save_mtp``, and nothing prints.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..core.hidden import text_model
from ..drafting.heads import dflash, eagle3, mtp
from ..drafting.heads.files import ROPES, rope_kind, text_config
from ..drafting.heads.targetparts import lm_head_weight
from ..errors import BadInput, IncompatiblePair
from ..paths import atomic_write

DRAFT_VOCAB = 32000  # EAGLE-3's draft vocabulary when not asked (SpecForge's default)
DFLASH_MIN_READ = 3  # a DFlash drafter reads at least this many target layers


def _rope_scaling(t: dict) -> dict | None:
    # the head's RoPE as the target's where the head kinds can run it (their loaders check)
    s = t.get("rope_scaling")
    return s if s is None or rope_kind(s) in ROPES else None


def _attention_shape(t: dict, width: int) -> dict:
    """Heads, kv heads, head_dim and MLP width of a layer ``width`` wide: the target's own at
    its width; narrower, as many of its heads as fit, grouped as its are."""
    hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    head_dim = int(t.get("head_dim") or hidden // heads)
    kv = int(t.get("num_key_value_heads") or heads)
    if width != hidden:
        group = heads // kv  # queries per kv head
        heads = max(1, width // head_dim)
        kv = heads // group if heads % group == 0 else heads
    return {
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": int(t["intermediate_size"]) * width // hidden,
    }


def head_json(kind: str, target_config: dict, *, layers: int, width: int, draft_vocab: int,
              block: int, mask_id: int) -> dict:  # fmt: skip
    """The config.json a head of ``kind`` over this target is published with: SpecForge's
    LlamaForCausalLMEagle3 or z-lab's DFlashDraftModel, its shapes after the target's.

    target_config: the target's config.json; layers: DFlash's decoder layers (EAGLE-3 has
    one); width: EAGLE-3's hidden size (0: the target's); draft_vocab: EAGLE-3's vocabulary (0: DRAFT_VOCAB
    or the target's if smaller); block: DFlash's block size; mask_id: DFlash's mask token."""
    t = text_config(target_config)
    hidden, depth_t, vocab = (
        int(t["hidden_size"]),
        int(t["num_hidden_layers"]),
        int(t["vocab_size"]),
    )
    common = {
        "hidden_act": "silu",
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(t.get("rope_theta", 10000.0)),
        "rope_scaling": _rope_scaling(t),
        "max_position_embeddings": int(t.get("max_position_embeddings") or 2048),
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if kind == eagle3.KIND:
        width = width or hidden
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": width,
            **_attention_shape(t, width),
            "num_hidden_layers": 1,
            "pretraining_tp": 1,
            **common,
            "draft_vocab_size": min(draft_vocab or DRAFT_VOCAB, vocab),
            "target_hidden_size": hidden,
            # EAGLE's defaults, written out: low, middle and high layer outputs
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, depth_t // 2 - 1, depth_t - 4]},
        }  # fmt: skip
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        **_attention_shape(t, hidden),
        "attention_bias": False,
        "num_hidden_layers": layers,
        **common,
        "block_size": block,
        "num_target_layers": depth_t,
        "dflash_config": {
            "mask_token_id": mask_id,
            "target_layer_ids": dflash.default_layers(depth_t, max(layers, DFLASH_MIN_READ)),
        },
    }


def check_head(kind: str, target_config: dict, where: str, **shape) -> dict:
    """The head's config.json for this target, checked as the loaders check a downloaded
    one (IncompatiblePair/BadInput in one line: a target too shallow for three distinct
    EAGLE-3 layers, say). shape: head_json's keyword arguments."""
    if kind == "mtp":  # no config of its own: the checkpoint's is the target's
        mtp.check_family(target_config, where)
        family = target_config.get("model_type")
        if family not in mtp.TRAINABLE:
            raise BadInput(
                f"cannot train an MTP head for {family} here: its head is written back only "
                f"for {', '.join(mtp.TRAINABLE)}"
            )
        return target_config
    config = head_json(kind, target_config, **shape)
    try:
        if kind == eagle3.KIND:
            c = eagle3.head_config(config, target_config, where)
            if c.heads % c.kv_heads or c.hidden % c.head_dim:
                raise BadInput(f"--width {c.hidden} does not split into {c.head_dim}-wide heads")
        else:
            dflash.head_config(config, target_config, where)
    except IncompatiblePair as e:
        raise BadInput(f"cannot train a {kind} head here: {e}") from None
    return config


# ---------------------------------------------------------------- making a head


def draft_ids(rows: np.ndarray, vocab: int, size: int) -> np.ndarray:
    """EAGLE-3's draft vocabulary: the ``size`` target ids the data uses most (ties to the
    lower id), ascending, as SpecForge picks it from token counts. rows: (N, L) token ids."""
    counts = np.bincount(rows.reshape(-1), minlength=vocab)[:vocab]
    order = np.lexsort((np.arange(vocab), -counts))  # most used first, then by id
    return np.sort(order[:size]).astype(np.int64)


def _projection(weight: mx.array, width: int) -> mx.array:
    """(T, width): the top right singular vectors of a (V, T) matrix (eigenvectors of its
    T x T Gram matrix), to carry the target's embedding and LM head into a narrower head's
    space; exact when the matrix has rank <= width, as a zero-padded stand-in's has."""
    gram = weight.T @ weight  # (T, T)
    _, vectors = np.linalg.eigh(np.array(gram, dtype=np.float64))  # ascending eigenvalues
    return mx.array(vectors[:, ::-1][:, :width].astype(np.float32))


def make_head(kind: str, target, config: dict, rows: np.ndarray):
    """A fresh head of ``kind`` over ``target`` (a loaded model: .model, .config) in its
    published layout ``config`` (check_head's), float32, with what it takes from the target
    set: EAGLE-3's draft vocabulary from ``rows`` (N, L) and its LM head and norm started as
    the target's (through a projection when narrower); DFlash's final norm as the target's.
    Returns (head, extra tensors to publish with it: EAGLE-3's d2t and t2d)."""
    model, t = target.model, text_config(target.config)
    inner = text_model(model)
    where = f"the {kind} head being trained"
    if kind == "mtp":
        head = mtp.MTPHead(model, target.config["model_type"])
        head.norm.weight = inner.norm.weight.astype(mx.float32)  # into the LM head as the target's
        head.set_dtype(mx.float32)
        return head, {}
    if kind == dflash.KIND:
        head = dflash.DFlashHead(model, dflash.head_config(config, target.config, where))
        head.norm.weight = inner.norm.weight.astype(mx.float32)
        head.set_dtype(mx.float32)
        return head, {}
    c = eagle3.head_config(config, target.config, where)
    own = c.hidden != int(t["hidden_size"])
    head = eagle3.Eagle3Head(model, c, own_embedding=own)
    ids = draft_ids(rows, c.vocab, c.draft_vocab)
    d2t = mx.array(ids - np.arange(len(ids)))
    t2d = np.zeros(c.vocab, dtype=bool)
    t2d[ids] = True
    w_out = lm_head_weight(model).astype(mx.float32)  # (V, T)
    if own:  # a narrower head: the target's embedding and LM head carried into its space
        p = _projection(w_out, c.hidden)  # (T, H)
        head.embed_tokens.weight = inner.embed_tokens.weight.astype(mx.float32) @ p
        head.lm_head.weight = w_out[mx.array(ids)] @ p
    else:
        head.lm_head.weight = w_out[mx.array(ids)]
        head.norm.weight = inner.norm.weight.astype(mx.float32)
    head.map_vocabulary(d2t if c.draft_vocab != c.vocab else None)
    head.set_dtype(mx.float32)
    if own:
        head.embed_tokens.freeze()  # the target's embedding, carried over: not trained
    return head, {"d2t": d2t.astype(mx.int64), "t2d": mx.array(t2d)}


def save_head(out: Path, head: nn.Module, config: dict, extra: dict[str, mx.array]) -> None:
    """The head as its authors publish it: config.json and model.safetensors (its own
    tensors under the published names, plus ``extra``: EAGLE-3's d2t/t2d)."""
    tensors = dict(tree_flatten(head.parameters()))
    tensors.update(extra)
    tmp = out / ".model.tmp.safetensors"
    mx.save_safetensors(str(tmp), tensors, metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    atomic_write(out / "config.json", json.dumps(config, indent=1) + "\n")


def save_mtp(out: Path, head: mtp.MTPHead, source: Path) -> None:
    """The target with this head: ``out`` links every file of the target's directory
    ``source`` and holds the head as mtp.TRAINED_FILE, in the checkpoint's layout (its norms
    zero-centred where the checkpoint's are)."""
    for f in source.iterdir():
        link = out / f.name
        if f.name != mtp.TRAINED_FILE and not link.exists():
            link.symlink_to(f.resolve())
    tmp = out / ".mtp.tmp.safetensors"
    tensors = mtp.checkpoint_tensors(head, mtp.is_raw(source))
    mx.save_safetensors(str(tmp), tensors, metadata={"format": "pt"})
    tmp.rename(out / mtp.TRAINED_FILE)
