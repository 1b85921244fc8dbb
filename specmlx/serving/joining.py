"""How a request becomes a row of the server's batch, the same on rank 0 and on the ranks
that follow it, and whether a pair can batch at all."""

from __future__ import annotations

from ..core.batch_caches import batchable
from ..core.kvstate import KVState
from ..core.stats import Stats
from ..decoding.batch import Batch, Row
from ..decoding.session import Pair, Request, Session
from .prompt_cache import PromptCache


def join_row(
    session: Session, cache: PromptCache, batch: Batch, r: Request, stats: Stats, taken: KVState
) -> Row:
    """Request ``r`` joins ``batch`` as a row, from ``taken`` (what the worker's prompt cache
    gave for its prompt) or a running row's prefix (Batch.share). Rank 0 and the ranks that
    follow it join alike.

    session: the worker's (its pair, and what a request asks the engine); cache: its prompt
    cache (the caches the row leaves with go back there); batch: the batch to join;
    stats: the request's, filled live; taken: worker.caches_for(r) (the caller keeps its
    ``sources``: a failure drops those entries)."""
    drafts = r.uses_draft and session.pair.draft is not None
    kv = batch.share(r.prompt_ids, taken) if r.cache_prompt else taken
    row = batch.join(r.prompt_ids, session.decode(r), kv, stats, drafts=drafts)
    cache.keep_branch(kv)
    return row


def can_batch(pair: Pair) -> str | None:
    """Why ``pair`` cannot run as a batch (None: it can)."""
    for what, model in (("target", pair.target), ("draft", pair.draft)):
        why = batchable(model) if model is not None else None
        if why:
            return f"the {what} {why}"
    return None
