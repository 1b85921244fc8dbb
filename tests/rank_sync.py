"""Run by test_distributed under two ranks (mlx.launch): SharedK with a carried Lockstep makes
one collective a round, gives every rank rank 0's k, and still catches ranks that diverge."""

import json
import sys

import mlx.core as mx

from specmlx.distributed import Lockstep, LockstepError, SharedK, join

world = join()
calls = {"all_gather": 0, "all_sum": 0}
for name in calls:  # count the collectives each round makes
    real = getattr(mx.distributed, name)

    def counted(*a, _real=real, _name=name, **kw):
        calls[_name] += 1
        return _real(*a, **kw)

    setattr(mx.distributed, name, counted)

diverge_at = int(sys.argv[1])  # the round from which rank 1 emits another token (-1: never)
ends = sys.argv[2:] == ["ends"]  # rank 1 then stops (its last token an EOS, say) and checks
lock = Lockstep(world)
ks = iter([3, 1, 4, 1, 5, 9, 2, 6])
shared = SharedK(lambda _last: next(ks) + 10 * world.rank, world, lock)  # rank 0's decides
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
print(json.dumps({"rank": world.rank, "ks": got, "calls": calls, "error": error}), flush=True)
