"""Speculation across machines: the target sharded over MLX's distributed backend (tensor
parallelism, mlx-lm's `model.shard(group)`), the draft replicated, every rank running the
same rounds in lockstep.

After the target's all-reduces every rank sees the same logits, so with the same seed and the
same k every rank accepts the same tokens. Three things keep them together: the seed is rank
0's; an adaptive chooser decides on rank 0 and the decision is shared (timings differ per
rank); and a running hash of the emitted tokens is compared every few rounds, so ranks that
ever disagree stop with one clear error instead of writing diverging text. A watchdog bounds
the wait for a rank that died or hangs. The ranks are started by `mlx.launch`; MLX is the
transport.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..core.stats import KChooser, RoundReport
from ..errors import SpecmlxError


class LockstepError(SpecmlxError):
    """The ranks emitted different tokens, or lost each other (exit code 1)."""


class RankFailure(SpecmlxError):
    """A rank failed, hangs or went away while the ranks served: the ranks can no longer be
    trusted to be in step, so every rank stops (exit code 1; the server answers 503)."""


class Cancelled(SpecmlxError):
    """Rank 0 stopped this generation (its client went away); raised on every rank."""


@dataclass
class World:
    """This process's place among the ranks (size 1: not distributed)."""

    group: mx.distributed.Group | None
    rank: int = 0
    size: int = 1
    backend: str = "none"

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that writes to stdout and stderr."""
        return self.rank == 0


def float_bits(x: float) -> int:
    """A float as the int64 of its IEEE bits: sent through an integer all-sum, every rank
    gets exactly rank 0's value."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def bits_float(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]


def share(world: World, values: Sequence[int], n: int | None = None) -> list[int]:
    """Rank 0's ``values`` on every rank (an all-sum where the others add zeros); the other
    ranks pass anything of the same length, or just ``n``.

    It runs on the current default stream, as the target's own all-reduces do: during a
    generation that orders it after a target pass still in flight (a queued plain pass),
    so every rank pairs the same collectives in the same order."""
    n = len(values) if n is None else n
    mine = [int(v) for v in values] if world.leader else [0] * n
    out = mx.distributed.all_sum(mx.array(mine, dtype=mx.int64), group=world.group)
    return [int(v) for v in out.tolist()]


def share_bytes(world: World, data: bytes, n: int | None = None) -> bytes:
    """Rank 0's ``data`` on every rank; the other ranks pass anything, with its length ``n``.

    The bytes travel zero-padded as int64 words, 8 to a word, through the same all-sum as
    ``share`` (the others add zeros, so every word arrives as rank 0 sent it): no other
    dtype has to be summed by every backend. On the default stream, as ``share``."""
    n = len(data) if n is None else n
    words = -(-n // 8)
    if words == 0:
        return b""
    mine = np.zeros(words, dtype="<i8")
    if world.leader:
        mine = np.frombuffer(data.ljust(words * 8, b"\0"), dtype="<i8")
    out = mx.distributed.all_sum(mx.array(mine), group=world.group)
    return np.array(out).astype("<i8").tobytes()[:n]


def shared_seed(world: World, seed: int | None) -> int | None:
    """Every rank must sample with the same key: rank 0's seed (drawn if None) for all."""
    if not world.distributed:
        return seed
    mine = seed if seed is not None else int.from_bytes(os.urandom(6), "little")
    return share(world, [mine])[0]


def shared_probe(world: World, store, model, identity: str, ids: list[int]) -> list[float]:
    """The target's pass-cost curve for adaptive k (store: a choosers.ChooserStore; model,
    identity: the target). Probing runs target passes, which are collective, so every rank
    probes or none does: rank 0's cached curve decides."""
    cached = store.cached_probe(identity) if world.leader else None
    if share(world, [cached is None])[0]:
        return store.probe(model, identity, ids)  # every rank, the same passes
    # rank 0's curve, to every rank: then no rank probes on its own later
    n = share(world, [len(cached or [])])[0]
    return [bits_float(b) for b in share(world, [float_bits(x) for x in cached or []], n)]


class SharedK(KChooser):
    """A k chooser whose decisions are rank 0's: each rank times its own rounds, so adaptive
    choosers would drift apart, and ranks that draft different k run different passes. One
    small collective a round carries k and plain_next, and with a ``lockstep`` the ranks'
    token hash too: the check rides on the k exchange, no second collective a round. A
    stoppable lockstep (the server's) is not carried: it compares each round's tokens before
    they reach a client, and carries rank 0's cancel, so it keeps its own collective.

    Of the chooser's other abilities, a lookup verifies up to the shared k (the protocol's
    default: an adaptive length from rank 0's timings would need a collective of its own
    each round) and drafts are not planned token by token (``plans`` False: the engine
    refuses per-token stopping over ranks by name)."""

    WIDTH = 2  # the integers a round's exchange carries: k and plain_next

    def __init__(self, inner: KChooser, world: World, lockstep: Lockstep | None = None):
        self.inner, self.world, self._plain = inner, world, False
        self.lockstep = lockstep if lockstep is not None and not lockstep.stoppable else None
        if self.lockstep is not None:
            # carried, it does not check on its own between rounds, and its last check carries
            # as many integers as an exchange, so ranks that end a round apart still pair up
            self.lockstep.carried = self.WIDTH

    def __call__(self, last: RoundReport | None) -> int:
        leader = self.world.leader
        k, plain = (self.inner(last), int(self.inner.plain_next())) if leader else (0, 0)
        if self.lockstep is not None:  # (rank 0's row of the all-gather)
            k, plain = self.lockstep.exchange([k, plain])
        else:
            k, plain = share(self.world, [k, plain])
        self._plain = bool(plain)
        return k

    def plain_next(self) -> bool:
        return self._plain


class Lockstep:
    """Compares a running hash of the emitted tokens across ranks every ``every`` rounds
    (one all-gather of a few integers); raises LockstepError on every rank if they differ.
    Called by the engine with each round's new tokens; the caller runs ``check()`` once more
    when generation ends. Carried by a SharedK (``carried``: the width of its exchange), it
    compares at each round's k exchange instead (``every`` then unused): a round's tokens
    are compared at the next round's start, or by the final check.

    stoppable: compare every round and carry rank 0's ``cancelled()`` with it, so that a
    generation rank 0 stops (the server's client hung up) stops on every rank at the same
    round (Cancelled); every rank passes stoppable, only rank 0 a ``cancelled``."""

    MOD = (1 << 31) - 1  # fits exactly in the int64 the collective carries

    def __init__(
        self,
        world: World,
        every: int = 4,
        beat: Callable[[], None] | None = None,
        *,
        stoppable: bool = False,
        cancelled: Callable[[], bool] | None = None,
    ):
        self.world, self.every, self.beat = world, 1 if stoppable else every, beat
        self.stoppable, self.cancelled = stoppable, cancelled
        self.hash, self.rounds, self.tokens = 0, 0, 0
        self.carried = 0  # > 0: a SharedK compares with its k exchange (this many extras)

    def __call__(self, tokens: list[int]) -> None:
        for t in tokens:
            self.hash = (self.hash * 1_000_003 + int(t) + 1) % self.MOD
        self.tokens += len(tokens)
        self.rounds += 1
        if self.beat is not None:
            self.beat()
        if not self.carried and self.rounds % self.every == 0:
            self.check()

    def check(self) -> None:
        """Compare now (callers do when generation ends). Carried, it sends as many
        integers as a round's exchange: a rank that ended a round early pairs with the
        others' next exchange and every rank raises LockstepError, instead of a hang."""
        self.exchange([0] * self.carried)

    def exchange(self, extra: Sequence[int]) -> list[int]:
        """Compare the ranks' hashes (LockstepError if they differ; Cancelled when stoppable
        and rank 0 was cancelled) and return rank 0's ``extra`` integers on every rank: one
        all-gather of [hash, tokens, stop, *extra] per rank. Every rank passes as many."""
        if not self.world.distributed:
            return list(extra)
        stop = int(bool(self.cancelled and self.cancelled()))
        mine = mx.array([self.hash, self.tokens, stop, *extra], dtype=mx.int64)
        # the default stream: after any target pass still in flight (see share)
        seen = mx.distributed.all_gather(mine[None], group=self.world.group).tolist()
        rows = [tuple(r[:2]) for r in seen]  # (ranks, 3 + len(extra)): rank 0's row first
        if len(set(rows)) > 1:
            raise LockstepError(
                f"the ranks generated different tokens (token counts {[r[1] for r in rows]}, "
                "hashes differ); stopped rather than go on writing diverging text"
            )
        if self.stoppable and seen[0][2]:
            raise Cancelled("cancelled by rank 0")
        return [int(v) for v in seen[0][3:]]


def lost_peer(e: BaseException) -> LockstepError | None:
    """The error to report when an MLX collective failed because another rank went away."""
    text = str(e)
    if isinstance(e, RuntimeError) and ("[ring]" in text or "peer" in text):
        return LockstepError(f"lost the connection to another rank ({text.strip()})")
    return None


def said(e: BaseException) -> str:
    """One line for an error on a rank: a lost peer as such, else its type and message."""
    lost = lost_peer(e)
    if lost is not None:
        return str(lost)
    return str(e) if isinstance(e, SpecmlxError) else f"{type(e).__name__}: {e}"


def ranks_stopped(e: BaseException) -> RankFailure:
    """What a client is told when ``e`` failed a generation the other ranks ran a part of:
    they may be out of step now, so every rank stops (a 503 naming the cause)."""
    return e if isinstance(e, RankFailure) else RankFailure(f"the ranks stopped: {said(e)}")


class Watchdog:
    """Ends the process with a clear error when the ranks make no progress for ``timeout``
    seconds: a rank that died mid-collective usually fails fast, one that hangs (or never
    connects) would otherwise block the others forever."""

    def __init__(self, timeout: float, say: Callable[[str], None]):
        self.timeout, self.say = timeout, say
        self.last = time.monotonic()
        self.what = "connecting to the other ranks"
        self._armed, self._idle = True, False
        threading.Thread(target=self._watch, daemon=True, name="specmlx-watchdog").start()

    def beat(self, what: str | None = None) -> None:
        """Progress (and, with ``what``, what the ranks are doing now): the clock restarts."""
        self.last = time.monotonic()
        self._idle = False
        if what is not None:
            self.what = what

    def idle(self) -> None:
        """Nothing is expected of the other ranks (a server between requests) until the
        next beat."""
        self._idle = True

    def disarm(self) -> None:
        self._armed = False

    def _watch(self) -> None:
        while self._armed:
            time.sleep(min(1.0, self.timeout / 4))
            late = time.monotonic() - self.last > self.timeout
            if self._armed and not self._idle and late:
                self.say(
                    f"no progress from the other ranks for {self.timeout:.0f} s while "
                    f"{self.what} (a rank died, hangs or never connected); stopping"
                )
                os._exit(1)


# ---------------------------------------------------------------- launching the ranks


def barrier(world: World) -> None:
    """Wait until every rank gets here (one all-sum)."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=world.group, stream=mx.cpu))
