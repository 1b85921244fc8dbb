"""Run by test_distributed under two ranks (mlx.launch).

`rank_sync.py DIVERGE [ends]`: SharedK with a carried Lockstep makes one collective a round,
gives every rank rank 0's k, and still catches ranks that diverge.
`rank_sync.py request`: the server worker hands rank 1 a request (every field off its
default), an idle tick and the stop, as it does between generations; rank 1 prints what it
got, each rank the collectives it made."""

import json
import sys
from dataclasses import asdict

import mlx.core as mx
from helpers import Script

from specmlx.core.sampling import SamplingParams
from specmlx.decoding.session import DrafterChoice, Request
from specmlx.distributed.launch import join
from specmlx.distributed.ranks import Lockstep, LockstepError, SharedK
from specmlx.distributed.wire import IDLE, receive, send
from specmlx.drafting.choosing.choosers import K

world = join()
calls = {"all_gather": 0, "all_sum": 0}
for name in calls:  # count the collectives each round makes
    real = getattr(mx.distributed, name)

    def counted(*a, _real=real, _name=name, **kw):
        calls[_name] += 1
        return _real(*a, **kw)

    setattr(mx.distributed, name, counted)


def lockstep(diverge_at: int, ends: bool) -> dict:
    """diverge_at: the round from which rank 1 emits another token (-1: never); ends: rank 1
    then stops (its last token an EOS, say) and checks."""
    lock = Lockstep(world)
    ks = iter([3, 1, 4, 1, 5, 9, 2, 6])
    shared = SharedK(
        Script(lambda _last: next(ks) + 10 * world.rank), world, lock
    )  # rank 0's decides
    got, error = [], None
    try:
        for r in range(8):
            got.append(shared(None))
            lock([7 + (world.rank if 0 <= diverge_at <= r else 0)])
            if ends and world.rank == 1 and r == diverge_at:
                break  # its final check meets rank 0's next k exchange: the same shape
        lock.check()
    except LockstepError as e:
        error = str(e)
    return {"ks": got, "error": error}


def request() -> dict:
    sent = Request(
        sampling=SamplingParams(0.7, 0.9, 40, 0.05), k=K(5), max_tokens=17,
        seed=2**47 + 3, stop=["\n\n", "é\0x"], drafter=DrafterChoice.of("lookup"), extra_eos=(7, 9),
        verify="token", draft_stop=True, time_limit_s=1.5, min_indent=4,
        prompt_ids=list(range(1000, 1300)), warm_up=True,
    )  # fmt: skip
    if world.rank == 0:
        for r in (sent, IDLE, None):
            send(world, r)
        return {"sent": asdict(sent)}
    got = [receive(world, Request) for _ in range(3)]
    return {"got": asdict(got[0]), "equal": got[0] == sent, "then": [got[1] is IDLE, got[2]]}


if sys.argv[1:] == ["request"]:
    out = request()
else:
    out = lockstep(int(sys.argv[1]), sys.argv[2:] == ["ends"])
print(json.dumps({"rank": world.rank, "calls": calls, **out}), flush=True)
