"""The EAGLE-3 kit: a head's steps against the reference's (SafeAILab/EAGLE's ``cnets.py``,
tests/reference/eagle3_cnets.py, run in PyTorch): the reference's first pass and chained
steps, specmlx's head over the same inputs (specmlx/drafting/eagle3.py), and whether every
step agrees. Used by test_eagle3 (random heads in the released layout) and test_distill_heads
(heads that `specmlx distill --head eagle3` saved)."""

import mlx.core as mx
import numpy as np
import torch


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
