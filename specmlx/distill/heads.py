"""A head distillation's trainee (`specmlx distill --head eagle3|dflash|mtp`): the head of a
run's settings over its target, with its loss, held-out estimate and save.

The head's published layout, how it is made and saved: published.py; its training forwards,
losses and estimates by depth: forwards.py. Nothing here writes to disk or prints.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..drafting.heads import eagle3
from ..drafting.heads.files import text_config
from ..errors import BadInput
from ..models.sources import fetch
from .forwards import (
    anchors_for,
    dflash_estimate,
    dflash_loss,
    eagle3_estimate,
    eagle3_loss,
    mtp_estimate,
    mtp_loss,
)
from .published import check_head, make_head, save_head, save_mtp
from .student import LOSS, DistillConfig, Trainee, check_target, trainable


def head_shape(config: DistillConfig, target_config: dict) -> dict:
    """head_json's keyword arguments for a run's settings (DFlash's mask token: the
    target's last id, a row its embedding has that text rarely uses)."""
    vocab = int(text_config(target_config)["vocab_size"])
    return {"layers": config.layers, "width": config.width, "draft_vocab": config.draft_vocab,
            "block": config.block, "mask_id": vocab - 1}  # fmt: skip


def anchors_per_row(config: DistillConfig) -> int:
    """DFlash blocks trained per row: a block for every two blocks' width of it."""
    return max(1, config.seq_len // (2 * config.block))


def head_trainee(target, config: DistillConfig, rows: np.ndarray) -> Trainee:
    """A fresh head of ``config.head`` over ``target`` (a Loaded) as a run's trainee, its
    draft vocabulary (EAGLE-3) from the training rows (N, L). BadInput where the target
    cannot have one (check_head)."""
    check_target(target, config)
    published = check_head(config.head, target.config, target.spec.alias,
                           **head_shape(config, target.config))  # fmt: skip
    mx.random.seed(config.seed)
    head, extra = make_head(config.head, target, published, rows)
    loss_fn = LOSS[config.loss]
    facts = {
        "kind": config.head,
        "reads": list(head.reads_hidden),
        "head_params": sum(v.size for _, v in tree_flatten(head.parameters())),
        "trained_params": sum(v.size for v in trainable(head).values()),
    }
    if config.head == "mtp":
        source = fetch(target.spec)
        if not source.is_dir():
            raise BadInput(
                "--head mtp needs the target as a model directory: its head is written "
                f"beside the checkpoint's files ({target.spec.alias} is {source.name})"
            )
        facts.update(family=head.family, depth=1)
        return Trainee(
            model=head,
            reads=head.reads_hidden,
            loss=lambda b: mtp_loss(head, loss_fn, b),
            estimate=lambda h: mtp_estimate(head, h["feats"], h["rows"], h["p"]),
            save=lambda out: save_mtp(out, head, source),
            facts=facts,
        )
    if config.head == eagle3.KIND:
        facts.update(width=head.config.hidden, draft_vocab=head.config.draft_vocab,
                     depth=config.depth)  # fmt: skip
        return Trainee(
            model=head,
            reads=head.reads_hidden,
            loss=lambda b: eagle3_loss(head, loss_fn, b, config.depth),
            estimate=lambda h: eagle3_estimate(head, h["feats"], h["rows"], h["p"], config.depth),
            save=lambda out: save_head(out, head, published, extra),
            facts=facts,
        )
    count, n = anchors_per_row(config), config.seq_len
    facts.update(block=config.block, layers=config.layers, anchors_per_row=count)

    def held_estimate(h: dict) -> dict:
        # the same anchors at every estimate: one fixed draw of the run's seed
        rng = np.random.default_rng([config.seed, 2**31 - 1])
        at = anchors_for(n, config.block, count, rng, h["rows"].shape[0])
        return dflash_estimate(head, h["feats"], h["rows"], h["p"], config.block, at)

    return Trainee(
        model=head,
        reads=head.reads_hidden,
        loss=lambda b: dflash_loss(head, loss_fn, b, config.block),
        estimate=held_estimate,
        save=lambda out: save_head(out, head, published, extra),
        facts=facts,
        extra=lambda step, b: {
            "anchors": anchors_for(
                n, config.block, count, np.random.default_rng([config.seed, step]), b
            )  # fmt: skip
        },
    )
