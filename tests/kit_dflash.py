"""The DFlash kit: a drafter's blocks against the reference's (z-lab/dflash's ``model.py``,
tests/reference/dflash_model.py, run in PyTorch): rounds of context and blocks as the
reference's ``dflash_generate`` calls its drafter, specmlx's drafter over the same rounds
(specmlx/drafting/heads/dflash.py), and whether every round agrees. Used by test_dflash (random
drafters in the released layout) and test_distill_heads (drafters that `specmlx distill
--head dflash` saved)."""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent / "reference"))
import dflash_model as reference  # noqa: E402


class LegacyCache(reference.DynamicCache):
    """transformers' DynamicCache with the ``crop(n)`` the reference was written against
    (keep the first n positions); transformers 5 takes only ``crop(-removed)``."""

    def crop(self, max_length: int) -> None:
        removed = self.get_seq_length() - max_length
        if removed > 0:
            super().crop(-removed)


# rounds of (new context features, the block's first token, its width): the first reads a
# prompt's worth of context, later ones what a round confirmed, one reads nothing new
ROUNDS = [(6, 7, 8), (3, 100, 8), (1, 3, 4), (0, 9, 5), (2, 50, 8)]


def ref_rounds(model, target, feats: np.ndarray):
    """The reference drafter over ROUNDS as ``dflash_generate`` calls it: the context cache
    cropped back to the confirmed positions after each block; logits from the target's LM
    head on the block's last width - 1 positions."""
    embed = torch.tensor(np.array(target.model.embed_tokens.weight))
    head = torch.tensor(np.array(target.lm_head.weight))
    cache, start, used, out = LegacyCache(), 0, 0, []
    with torch.no_grad():
        for new, first, width in ROUNDS:
            start += new
            block = torch.tensor([[first] + [model.mask_token_id] * (width - 1)])
            h = model(
                target_hidden=torch.tensor(feats[:, used:start]),
                noise_embedding=embed[block],
                position_ids=torch.arange(cache.get_seq_length(), start + width)[None],
                past_key_values=cache,
                use_cache=True,
                is_causal=False,
            )
            cache.crop(start)
            used = start
            out.append((h[:, 1 - width :] @ head.T).numpy())
    return out


def our_rounds(head, feats: np.ndarray):
    cache, used, out = head.make_cache(), 0, []
    for new, first, width in ROUNDS:
        rows = mx.array(feats[:, used : used + new]) if new else None
        out.append(np.array(head.block(rows, mx.array([first]), width, cache)))
        used += new
    return out


def agree(ours, ref) -> bool:
    return all(np.allclose(a, b, atol=2e-4, rtol=1e-4) for a, b in zip(ours, ref, strict=True))
