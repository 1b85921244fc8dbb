"""The EAGLE-3 kit: a head's steps against the reference's (SafeAILab/EAGLE's ``cnets.py``,
tests/reference/eagle3_cnets.py, run in PyTorch): the reference's first pass and chained
steps, specmlx's head over the same inputs (specmlx/drafting/heads/eagle3.py), and whether every
step agrees. Used by test_eagle3 (random heads in the released layout) and test_distill_heads
(heads that `specmlx distill --head eagle3` saved)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent / "reference"))
import eagle3_cnets as reference  # noqa: E402


def ref_steps(model, feats: torch.Tensor, tokens: torch.Tensor, chained: list[int]):
    """The reference's first pass over (feats, tokens) and one chained step per token in
    ``chained`` (the previous step's last output fed back, as topK_genrate does): each
    step's hidden output and its logits over the draft vocabulary."""
    out = []
    with torch.no_grad():
        h, kv = model(feats, input_ids=tokens, use_cache=True)
        out.append((h, model.lm_head(model.norm(h))))
        for t in chained:
            h, kv = model(h[:, -1:], input_ids=torch.tensor([[t]]), past_key_values=kv,
                          use_cache=True)  # fmt: skip
            out.append((h, model.lm_head(model.norm(h))))
    return out


def our_steps(head, feats: np.ndarray, tokens: np.ndarray, chained: list[int]):
    cache = head.make_cache()
    g, logits = head(mx.array(feats), mx.array(tokens), cache)
    out = [(g, logits)]
    for t in chained:
        g, logits = head(g[:, -1:], mx.array([[t]]), cache)
        out.append((g, logits))
    return out


def agree(ours, ref, draft_ids) -> bool:
    """Every step's hidden output and logits within float32 tolerance; logits compared at
    the draft vocabulary's target ids, -inf at every other id."""
    for (g, logits), (rh, rl) in zip(ours, ref, strict=True):
        g, logits = np.array(g), np.array(logits)
        if not np.allclose(g, rh.numpy(), atol=2e-4, rtol=1e-4):
            return False
        if not np.allclose(logits[..., draft_ids], rl.numpy(), atol=2e-4, rtol=1e-4):
            return False
        outside = np.setdiff1d(np.arange(logits.shape[-1]), draft_ids)
        if outside.size and not np.all(np.isneginf(logits[..., outside])):
            return False
    return True


def head_json(vocab: int, hidden: int = 32, draft_vocab: int | None = None, **over) -> dict:
    """An EAGLE-3 config.json as the published heads have it (yuhuili/EAGLE3-*)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab or vocab,
        "pretraining_tp": 1,
        "torch_dtype": "float32",
        **over,
    }


def random_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A reference model's weights drawn at random in place (norms near one, so their
    places matter; the rest at 0.3), as every head's reference check draws them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def reference_head(config: dict, seed: int, embed: np.ndarray | None, draft_ids=None):
    """The reference Model on random weights (norms too, so their places matter), with the
    d2t/t2d buffers for ``draft_ids`` (the target ids of the draft vocabulary, ascending)."""
    torch.manual_seed(seed)
    ns = SimpleNamespace(pad_token_id=None, **config)
    model = random_weights(reference.Model(ns).float().eval())
    with torch.no_grad():
        if embed is not None:
            model.embed_tokens.weight.copy_(torch.tensor(embed))
        if draft_ids is not None:
            ids = torch.tensor(draft_ids)
            model.d2t.copy_(ids - torch.arange(len(ids)))
            model.t2d.zero_()
            model.t2d[ids] = True
    return model


def save_head(path: Path, model, config: dict, ship_embedding: bool) -> Path:
    """The reference model's weights as the released heads lay them out."""
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not ship_embedding:
        state.pop("embed_tokens.weight")  # EAGLE's own heads: the target's is loaded
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path
