"""Starting and ending ranks: `specmlx ... --hosts/--hostfile` runs the same command as
ranks under mlx.launch (the ring backend over TCP, or what a hostfile names), relays their
output (each line once: a rank's error is shown only when rank 0 did not already say it),
and turns their exit codes into one; a rank ends itself when its launcher goes. What the
ranks do once started (collectives, lockstep, the shared k) is ranks.py.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

from ..errors import BadInput
from .ranks import World


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


# the ring backend's own lines (C++ writes them to fd 2 before raising what we report)
_RING_NOISE = re.compile(
    r"^\[ring\]|^(Sending to|Receiving from) socket \d+ |^(Send|Recv) failed with errno"
    r"|^Socket .*closed by the peer"
)


# seconds the other ranks get to exit once the launcher reports a rank gone, before all are
# killed (a hung or stopped rank never exits by itself)
RANK_GONE_GRACE, RANK_0_GONE_GRACE = 15.0, 3.0
_RANK_REPORT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
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


def free_ports(n: int, tries: int = 50) -> int:
    """The first of n consecutive loopback ports that are free now, drawn at random: ranks on
    this machine listen on them. mlx.launch's fixed default (32323 on) let two jobs started
    at once connect to each other's ranks (the lockstep check then stopped both)."""
    rng = random.SystemRandom()
    for _ in range(tries):
        first = rng.randrange(20_000, 60_000 - n)
        socks = []
        try:
            for port in range(first, first + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise BadInput(f"no {n} free consecutive ports on 127.0.0.1 for the ranks")


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
        ips = parse_hosts(hosts, None)
        cmd += ["--backend", "ring", "--hosts", ",".join(ips)]
        if all(ipaddress.ip_address(ip).is_loopback for ip in ips):
            cmd += ["--starting-port", str(free_ports(len(ips)))]
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
                # that hangs (or is stopped); give it a bounded time, then end them all.
                # Rank 0 gone: nothing is left to answer or print, so a short grace; another
                # rank gone: rank 0 may still be telling its clients why
                grace = RANK_0_GONE_GRACE if int(m.group(1)) == 0 else RANK_GONE_GRACE
                timer = threading.Timer(grace, _kill_group, (proc,))
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
