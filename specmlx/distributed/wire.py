"""The wire format between ranks when the server runs over them: what rank 0 hands the
other ranks (a request, a batch's next step, "nothing yet", "stop") and how a request
travels (a dataclass as JSON, rebuilt on the other side by its type hints). Two collectives
a message: one says what comes and its size, the second carries it. The request class
(decoding/session.py's ``Request``, a layer above) is a parameter here: this layer does not
import it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, is_dataclass
from functools import cache
from types import UnionType
from typing import TypeVar, Union, get_args, get_origin, get_type_hints

from .ranks import World, share, share_bytes

T = TypeVar("T")

IDLE = object()  # receive's "nothing yet"
_STOP, _REQUEST, _IDLE, _BATCH = 0, 1, 2, 3  # what rank 0's first collective says comes next


@dataclass
class BatchOps:
    """What rank 0's batch does next, for the other ranks to do the same, in this order: the
    rows that left since the last message (their indices in the batch, in the order they
    left: no collective, so they wait for the next message), then a request that joins (its
    prefill is collective: sent before rank 0 runs it; None: none), then a round of k[i]
    drafts for row i (None: no round)."""

    leave: list[int]
    join: object | None  # a session.Request (any dataclass), or None
    k: list[int] | None


def send_ops(world: World, ops: BatchOps) -> None:
    """Rank 0: tell the other ranks what its batch does next (one collective says a
    BatchOps comes and its size, a second carries it)."""
    data = json.dumps(
        {"leave": ops.leave, "join": asdict(ops.join) if ops.join else None, "k": ops.k},
        separators=(",", ":"),
    ).encode()
    share(world, [_BATCH, len(data)])
    share_bytes(world, data)


def send(world: World, r) -> None:
    """Rank 0: hand one request (a dataclass; None: stop following; IDLE: nothing yet) to
    the others: one collective says what comes and its size, a second (a request's)
    carries it packed."""
    if r is None or r is IDLE:
        share(world, [_STOP if r is None else _IDLE, 0])
        return
    data = pack(r)
    share(world, [_REQUEST, len(data)])
    share_bytes(world, data)


def receive(world: World, cls: type[T]) -> T | BatchOps | object | None:
    """Other ranks: wait for rank 0's next request, a ``cls`` (None: stop; IDLE: nothing
    yet; a BatchOps: what its batch does next, its joining request a ``cls``)."""
    kind, size = share(world, [], 2)
    if kind == _STOP:
        return None
    if kind == _IDLE:
        return IDLE
    if kind == _BATCH:
        ops = json.loads(share_bytes(world, b"", size))
        join = _revive(cls, ops["join"]) if ops["join"] is not None else None
        return BatchOps(ops["leave"], join, ops["k"])
    return unpack(cls, share_bytes(world, b"", size))


def pack(request: object) -> bytes:
    """A dataclass (a session.Request) as JSON bytes, every field of it (nested
    dataclasses as objects): a field added to the class travels with no edit here.

    request: the dataclass to send."""
    return json.dumps(asdict(request), separators=(",", ":")).encode()


def unpack(cls: type[T], data: bytes) -> T:
    """``pack``'s bytes back as a ``cls`` equal to the one packed.

    cls: the dataclass packed; data: what pack made of it."""
    return _revive(cls, json.loads(data))


@cache
def _hints(cls: type) -> dict:
    return get_type_hints(cls)


def _revive(kind, value):
    """A JSON value as the type ``kind`` says: JSON has no dataclasses or tuples, so those
    are rebuilt, and a float field rank 0 held as an int (temperature 0) comes back a float;
    a union is tried member by member; anything else is as JSON gave it (a list, str, int,
    bool or None)."""
    if is_dataclass(kind) and isinstance(value, dict):
        hints = _hints(kind)
        return kind(**{k: _revive(hints[k], v) for k, v in value.items()})
    if get_origin(kind) is tuple and isinstance(value, list):
        return tuple(value)
    if kind is float and type(value) is int:
        return float(value)
    if get_origin(kind) in (Union, UnionType):
        for member in get_args(kind):
            revived = _revive(member, value)
            if revived is not value:
                return revived
    return value
