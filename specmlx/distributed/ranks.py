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

import ipaddress
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..core.stats import KChooser, RoundReport
from ..errors import BadInput, SpecmlxError


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


def launched() -> bool:
    """Whether this process was started as a rank by mlx.launch (or mpirun)."""
    env = os.environ
    return "MLX_RANK" in env or "OMPI_COMM_WORLD_RANK" in env


def join() -> World:
    """Join the ranks this process was launched with (a World of one when it was not)."""
    if not launched():
        return World(None)
    # the prompt comes in argv; a closed stdin also stops mlx.launch polling it (see launch)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    # `launch` starts mlx.launch with Ctrl-C ignored, and ranks inherit that: take it back
    signal.signal(signal.SIGINT, signal.default_int_handler)
    watch_parent()
    group = mx.distributed.init()
    env = os.environ
    backend = (
        "ring"
        if env.get("MLX_HOSTFILE") is not None
        else "jaccl"
        if any(k.startswith("MLX_IBV") or k.startswith("MLX_JACCL") for k in env)
        else "mpi"
        if "OMPI_COMM_WORLD_RANK" in env
        else "unknown"
    )
    return World(group, group.rank(), group.size(), backend)


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
            # it no longer checks on its own between rounds, and its last check carries as
            # many integers as an exchange, so ranks that end a round apart still pair up
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


def watch_parent(every: float = 1.0) -> None:
    """End this rank when its launcher goes (the process that started it: mlx.launch, or the
    ssh session on a remote host): a rank left running would hold its memory and its port
    for nothing. Polls the parent's pid, which becomes another when the parent dies."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        try:  # (the launcher held this rank's stderr: it may be a closed pipe now)
            sys.stderr.write(f"error: {rank_prefix()}the launcher went away; stopping\n")
        except (OSError, ValueError):
            pass
        leave(1)

    threading.Thread(target=watch, daemon=True, name="specmlx-parent").start()


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

_RANK_REPORT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
# the ring backend's own lines (C++ writes them to fd 2 before raising what we report)
_RING_NOISE = re.compile(
    r"^\[ring\]|^(Sending to|Receiving from) socket \d+ |^(Send|Recv) failed with errno"
    r"|^Socket .*closed by the peer"
)
_RANK_ERROR = re.compile(r"^error: rank \d+: (.*)")  # see rank_prefix


def rank_prefix() -> str:
    """ "rank N: " for the errors of a rank other than 0 (the launcher shows them only when
    rank 0 did not already say the same)."""
    rank = os.environ.get("MLX_RANK")
    return f"rank {rank}: " if rank not in (None, "0") else ""


def parse_hosts(hosts: str | None, hostfile: Path | None) -> list[str]:
    """The ranks' addresses from --hosts (comma separated; `localhost` means 127.0.0.1) or
    MLX's JSON hostfile, checked before anything starts; BadInput says what is wrong."""
    if hosts and hostfile:
        raise BadInput("give --hosts or --hostfile, not both")
    if hostfile is not None:
        try:
            data = json.loads(Path(hostfile).read_text())
        except OSError as e:
            raise BadInput(f"cannot read --hostfile {hostfile}: {e.strerror or e}") from None
        except ValueError as e:
            raise BadInput(f"--hostfile {hostfile} is not JSON: {e}") from None
        entries = data.get("hosts") if isinstance(data, dict) else data
        if not isinstance(entries, list) or len(entries) < 2:
            raise BadInput(
                f'--hostfile {hostfile}: expected {{"hosts": [{{"ssh": ..., "ips": [...]}}, ...]}} '
                "with at least two hosts (MLX's hostfile format)"
            )
        out = []
        for i, h in enumerate(entries):
            if (
                not isinstance(h, dict)
                or not h.get("ssh")
                or not isinstance(h.get("ips", []), list)
            ):
                raise BadInput(f'--hostfile {hostfile}: host {i} needs "ssh" and a list "ips"')
            out.append(str(h["ssh"]))
        return out
    names = [h.strip() for h in (hosts or "").split(",")]
    if len(names) < 2 or not all(names):
        raise BadInput(f"--hosts needs two or more comma-separated hosts, got {hosts!r}")
    out = []
    for h in names:
        h = "127.0.0.1" if h == "localhost" else h
        try:
            ipaddress.ip_address(h)
        except ValueError:
            raise BadInput(
                f"--hosts {h}: the ring backend connects by IP address; give IPs (or "
                "localhost), or a --hostfile with the ssh names and their IPs"
            ) from None
        out.append(h)
    return out


def leave(code: int = 0) -> None:
    """End a rank's process now, after flushing its output. Past this point a rank has nothing
    left to do, and MLX's ring backend can abort in its own teardown at interpreter exit
    ("terminate called without an active exception", seen once in a full test run, on a two-rank
    server), which would turn a clean stop into a rank killed by signal 6."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say anyway
            pass
    os._exit(code)


def barrier(world: World) -> None:
    """Wait until every rank gets here (one all-sum)."""
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=world.group, stream=mx.cpu))


def launch(
    argv: list[str], hosts: str | None, hostfile: Path | None, secret: str | None = None
) -> int:
    """Run `specmlx ARGV` as ranks under mlx.launch; return the exit code. --hosts use the
    ring backend; a hostfile names its own (ring over Ethernet or Thunderbolt, jaccl for RDMA).

    argv: the command's arguments, without --hosts/--hostfile; secret: a line every rank
    gets first on its stdin (mlx.launch forwards it, over ssh too): an API key never goes
    in argv or the environment, where `ps` and remote shells would show it. Rank 0's output passes
    through; the launcher's and the ring's own noise is filtered, and its per-rank exit
    reports become this process's exit code (mlx.launch itself always exits 0)."""
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    cmd = [launcher, "--python", sys.executable]
    if hostfile is not None:  # its "backend" decides (ring by default; jaccl for RDMA)
        cmd += ["--hostfile", str(hostfile)]
    else:
        cmd += ["--backend", "ring", "--hosts", ",".join(parse_hosts(hosts, None))]
    cmd += ["--", "-m", "specmlx", *argv]
    codes: dict[int, int] = {}
    said: list[str] = []  # rank 0's error lines
    held: list[tuple[str, str]] = []  # the other ranks' (line, message)
    # stdin: a pipe left open (the launcher forwards stdin to every rank and would spin on
    # an end of file); the prompt travels in argv
    # the launcher ignores Ctrl-C (the ranks take it: rank 0 prints what it has) and lives in
    # a process group of its own, so that a closed pipe or a failure can stop it all
    env = {k: v for k, v in os.environ.items() if k != "SPECMLX_API_KEY"}  # (see secret)
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    if secret is not None:
        proc.stdin.write(secret.encode() + b"\n")
        proc.stdin.flush()

    def relay_stderr() -> None:
        for raw in proc.stderr:
            line = re.sub(r"\x1b\[[0-9;]*m", "", raw.decode(errors="replace"))
            if m := _RANK_REPORT.search(line):
                codes[int(m.group(1))] = int(m.group(2)) if m.group(2) else -9
                # a rank that failed: the launcher stops the others, but cannot stop one
                # that hangs (or is stopped); give it a bounded time, then end them all
                timer = threading.Timer(15, _kill_group, (proc,))
                timer.daemon = True
                timer.start()
            elif m := _RANK_ERROR.match(line.strip()):
                held.append((line, m.group(1).strip()))
            elif not _RING_NOISE.match(line.strip()):
                if line.startswith("error: "):
                    said.append(line[len("error: ") :].strip())
                sys.stderr.write(raw.decode(errors="replace"))
                sys.stderr.flush()

    def unspin() -> None:
        # mlx.launch polls each rank's stdin for writing, which never blocks: a busy loop
        # that takes a core. Ranks close their stdin (see `join`); a byte sent now and then
        # then fails to reach them, and the launcher stops polling that pipe.
        while proc.poll() is None:
            try:
                proc.stdin.write(b"\n")
                proc.stdin.flush()
            except (BrokenPipeError, OSError):
                return
            time.sleep(0.5)

    relay = threading.Thread(target=relay_stderr, daemon=True)
    relay.start()
    threading.Thread(target=unspin, daemon=True).start()
    # SIGTERM (a service manager stopping us) reaches the ranks as Ctrl-C: a server drains
    # and exits 0, a run prints what it has
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(proc.pid, signal.SIGINT))
    try:
        while chunk := proc.stdout.read1(65536):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
        proc.wait()
    except KeyboardInterrupt:  # rank 0 prints what it has and its stats, then exits 130
        os.killpg(proc.pid, signal.SIGINT)
        _drain(proc)
    except BrokenPipeError:  # the reader went away (| head): stop the ranks, end quietly
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    relay.join(timeout=5)
    for line, message in held:  # what rank 0 did not say already
        if message not in said:
            sys.stderr.write(line if line.endswith("\n") else line + "\n")
    return _exit_code(codes, sys.stderr, bool(said))


def _exit_code(codes: dict[int, int], err, explained: bool = False) -> int:
    """This command's exit code from the launcher's per-rank reports (rank -> code, negative
    for a signal). Rank 0's own failure (it printed why) wins; a rank that died otherwise is
    named in one line, since the launcher stopped the others (SIGTERM) before they could --
    unless rank 0 already printed an error (``explained``: it saw the peer go, and the
    launcher's SIGTERM may have reached it before it could exit with its own code)."""
    if not any(codes.values()):
        return 0
    own = codes.get(0, 0)
    if own > 0:
        return own
    if explained:
        return 1
    culprit = next(
        ((r, c) for r, c in sorted(codes.items()) if c > 0 or (c < 0 and c != -signal.SIGTERM)),
        None,
    )
    if culprit is not None:
        r, c = culprit
        how = f"was killed by signal {-c}" if c < 0 else f"exited with code {c}"
        err.write(f"error: rank {r} {how}; the other ranks were stopped\n")
        err.flush()
        return c if c > 0 else 1
    return 1


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _drain(proc: subprocess.Popen) -> None:
    try:
        while chunk := proc.stdout.read1(65536):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        proc.wait(timeout=60)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        _kill_group(proc)
