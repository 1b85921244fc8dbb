"""The target split over two local ranks (MLX's ring backend over loopback, started by
mlx.launch): token-identical to one process, greedy and sampled; lockstep, failures and the
per-rank memory plan. Real-weight tests (SmolLM2 widened to 18/6 heads) are marked slow."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin, get_type_hints

import pytest
from helpers import Script, Server, tiny_pair
from kit_ranks import PROMPT, TWO, specmlx, tokens

from specmlx.core.sampling import SamplingParams
from specmlx.decoding.session import Request
from specmlx.distributed.launch import _RING_NOISE, _exit_code, parse_hosts
from specmlx.distributed.ranks import Lockstep, SharedK, World
from specmlx.distributed.wire import pack, unpack
from specmlx.errors import BadInput
from specmlx.models.sharding import check_shardable


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dist")
    toml = tiny_pair(root)  # 4 query / 2 KV heads: they split in two
    env = dict(os.environ, SPECMLX_MODELS=str(toml), SPECMLX_HOME=str(root / "home"))
    env["XDG_CONFIG_HOME"] = str(root / "xdg")
    for name in ("SPECMLX_SERVER", "SPECMLX_MEMORY_BUDGET", "MLX_RANK"):
        env.pop(name, None)
    return {"root": root, "env": env}


# ------------------------------------------------------------------ checks before anything runs


def test_hosts_and_hostfiles_are_checked(tmp_path):
    assert parse_hosts("localhost,127.0.0.1", None) == ["127.0.0.1", "127.0.0.1"]
    for bad, words in (("one", "two or more"), ("a,b", "IP address"), ("1.2.3.4,", "two or more")):
        with pytest.raises(BadInput, match=words):
            parse_hosts(bad, None)
    hostfile = tmp_path / "hosts.json"
    for text, words in (
        ("{not json", "not JSON"),
        ('{"hosts": [{"ssh": "a", "ips": ["1.2.3.4"]}]}', "at least two hosts"),
        ('{"hosts": [{"ssh": "a"}, {"ips": ["1.2.3.4"]}]}', 'host 1 needs "ssh"'),
    ):
        hostfile.write_text(text)
        with pytest.raises(BadInput, match=words):
            parse_hosts(None, hostfile)
    hostfile.write_text('{"hosts": [{"ssh": "m1", "ips": ["10.0.0.1"]}, {"ssh": "m2", "ips": []}]}')
    assert parse_hosts(None, hostfile) == ["m1", "m2"]
    with pytest.raises(BadInput, match="cannot read"):
        parse_hosts(None, tmp_path / "missing.json")


def test_what_cannot_be_split_is_refused_clearly():
    smollm2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    with pytest.raises(BadInput, match=r"9 query / 3 KV heads .* do not split evenly over 2"):
        check_shardable(smollm2, 2, "smollm2-135m", True)
    check_shardable(smollm2, 3, "smollm2-135m", True)
    wide = {"num_attention_heads": 18, "num_key_value_heads": 6, "intermediate_size": 3072}
    check_shardable(wide, 2, "smollm2-135m-x2", True)  # the stand-in widened 2x splits
    with pytest.raises(BadInput, match="no tensor-parallel sharding"):
        check_shardable({"model_type": "mamba"}, 2, "m", False)


def test_exit_codes_from_the_launchers_reports():
    class Err:
        text = ""

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    err = Err()
    assert _exit_code({}, err) == 0 and _exit_code({0: 0, 1: 0}, err) == 0
    assert _exit_code({0: 2, 1: -15}, err) == 2 and not err.text  # rank 0 said why itself
    assert _exit_code({0: -15, 1: -9}, err) == 1
    assert err.text == "error: rank 1 was killed by signal 9; the other ranks were stopped\n"
    assert _exit_code({0: -15, 1: 3}, Err()) == 3
    quiet = Err()  # rank 0 printed why before the launcher's SIGTERM reached it: one line
    assert _exit_code({0: -15, 1: -9}, quiet, explained=True) == 1 and not quiet.text


def test_one_rank_needs_no_collectives():
    one = World(None)
    lock = Lockstep(one)
    lock([1, 2, 3])
    before = lock.hash
    lock([4])
    lock.check()  # nothing to compare with
    assert lock.hash != before and lock.tokens == 4
    inner = iter([3, 0, 2])
    shared = SharedK(Script(lambda _last: next(inner)), World(None, rank=0, size=1))
    assert [shared(None) for _ in range(3)] == [3, 0, 2]


@dataclass
class _Later(Request):
    """Request with fields added later, of kinds JSON does not keep (a tuple, a float
    that may hold an int, a nested dataclass): they travel with no edit to pack/unpack."""

    budget_s: float | None = None
    tags: tuple[str, ...] = ()
    also: SamplingParams = field(default_factory=SamplingParams)


def _off_default(kind, default, n: int):
    """A value of type ``kind`` other than ``default`` that its class accepts (n varies
    it): what a field added to the request may hold."""
    if get_origin(kind) in (Union, UnionType):
        kind = next(a for a in get_args(kind) if a is not type(None))
    origin, args = get_origin(kind) or kind, get_args(kind)
    if is_dataclass(kind):
        return _every_field_off(kind, n)
    if origin is Literal:  # (the last other value it names: LookupKind's "lookahead", the
        # kind whose every field is set)
        return next(a for a in reversed(args) if a != default)
    if kind is bool:
        return not default
    if kind is int:
        return (default if isinstance(default, int) else 0) + n + 1
    if kind is float:
        return default / 2 + 0.125 if isinstance(default, float) else 0.375  # (0, 1): valid
    if kind is str:
        return f"{default}-{n}\0é"
    if origin in (tuple, list, Sequence):
        items = [_off_default(args[0], None, n + i) for i in range(3)]
        return tuple(items) if origin is tuple else items
    raise AssertionError(f"no test value for a field of type {kind}: teach _off_default")


def _every_field_off(cls, n: int = 0):
    hints = get_type_hints(cls)
    values = {}
    for i, f in enumerate(fields(cls)):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        values[f.name] = _off_default(hints[f.name], default, n + i)
        assert values[f.name] != default, f.name
    return cls(**values)


@pytest.mark.parametrize("cls", [Request, _Later])
def test_a_request_travels_to_the_other_ranks_whole(cls):
    """What rank 0 sends the other ranks is every field of the request, each set off its
    default here: the one that comes back is equal, its tuples tuples, its floats floats."""
    sent = _every_field_off(cls)
    back = unpack(cls, pack(sent))
    assert back == sent and type(back.extra_eos) is tuple
    assert type(back.sampling.temperature) is float
    # a float field holding an int, a seed past 32 bits, an empty stop list
    odd = replace(sent, sampling=SamplingParams(0, 1, 0, 0), seed=2**47 + 3, stop=[])
    back = unpack(cls, pack(odd))
    assert back == odd and type(back.sampling.temperature) is float and back.stop == []


# ------------------------------------------------------------------ two local ranks


@pytest.mark.parametrize("k", ["3", "auto"])
def test_two_ranks_greedy_equals_one_process(models, k):
    env = models["env"]
    args = ["run", "--json", "-q", "-n", "40", "-k", k, PROMPT]
    one = specmlx(env, *args)
    two = specmlx(env, *args, *TWO)
    assert tokens(two) == tokens(one)
    ranks = json.loads(two.stdout)["ranks"]
    assert ranks["size"] == 2 and ranks["backend"] == "ring" and ranks["target_pass_s"] > 0


def test_two_ranks_sampled_with_a_seed_equal_one_process(models):
    env = models["env"]
    args = ["run", "--json", "-q", "-n", "40", "-k", "3", "--temp", "0.9", "--seed", "11"]
    one, two = specmlx(env, *args, PROMPT), specmlx(env, *args, *TWO, PROMPT)
    assert tokens(two) == tokens(one)
    other = specmlx(env, *args[:-1], "12", *TWO, PROMPT)
    assert tokens(other) != tokens(one)  # the seed matters: the comparison above means something


@pytest.mark.parametrize("temp", ["0", "0.9"])
def test_two_ranks_grow_the_trees_one_process_grows(models, temp):
    """EAGLE-2's grown trees (``--tree expand:8``) with the target split: each rank's draft
    grows the same tree, so the tokens, and every round's drafts and keeps, are one
    process's, greedy and seeded sampled. The target drafts for itself (each rank holds it
    whole as the draft), so trees are kept: the tiny pair's draft agrees with nothing."""
    env = models["env"]
    args = ["run", "--json", "-q", "-n", "40", "-k", "3", "--tree", "expand:8", "--temp", temp,
            "--seed", "11", "--draft", "tiny-t"]  # fmt: skip
    one, two = specmlx(env, *args, PROMPT), specmlx(env, *args, *TWO, PROMPT)
    assert tokens(two) == tokens(one)
    got, want = json.loads(two.stdout)["stats"], json.loads(one.stdout)["stats"]
    assert want["tree_rounds"] > 0 and want["accepted"] > 0, want
    for key in ("drafted", "accepted", "accept_hist", "tree_rounds"):
        assert got[key] == want[key], key


def test_a_second_job_on_one_machine_gets_ports_of_its_own(models):
    """Another job's ranks already listen on mlx.launch's default ports (32323 on): a local
    two-rank run listens on free ports of its own. With the fixed default its rank 0 could
    not bind, or one job's ranks connected to the other's (the lockstep check stopped both,
    seen when two tests ran two-rank jobs at once)."""
    held = []
    try:
        for port in (32323, 32324):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held.append(sock)
        done = specmlx(models["env"], "run", "--json", "-q", "-n", "12", *TWO, PROMPT)
    finally:
        for sock in held:
            sock.close()
    assert len(tokens(done)) == 12


def test_two_ranks_text_stats_stdin_and_one_writer(models):
    env = models["env"]
    two = specmlx(env, "run", "-n", "12", *TWO, "-", input=PROMPT)
    one = specmlx(env, "run", "-n", "12", "-q", PROMPT)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout  # rank 0's text only, once
    assert two.stderr.count("decode") == 1 and "ranks" in two.stderr and "2 (ring)" in two.stderr
    assert "[ring]" not in two.stderr and "WARN" not in two.stderr


def test_a_killed_rank_stops_the_other_with_a_clear_error(models):
    env = models["env"]
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "specmlx", "run", "-q", "-n", "1900", "-k", "3", *TWO, PROMPT],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    rank1 = _wait_for_rank(1, wrapper.pid)
    assert wrapper.stdout.read(1)  # rank 0 is writing: generation is under way
    os.kill(rank1, signal.SIGKILL)
    _, err = wrapper.communicate(timeout=60)  # (a hang fails here)
    assert wrapper.returncode == 1, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "rank" in lines[0], err


def test_a_hung_rank_is_bounded_by_the_watchdog(models):
    env = models["env"] | {"SPECMLX_RANK_TIMEOUT": "4"}
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "specmlx", "run", "-q", "-n", "1900", "-k", "3", *TWO, PROMPT],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    rank1 = _wait_for_rank(1, wrapper.pid)
    assert wrapper.stdout.read(1)
    os.kill(rank1, signal.SIGSTOP)  # alive but silent: no socket error to notice
    try:
        _, err = wrapper.communicate(timeout=60)
    finally:
        os.kill(rank1, signal.SIGCONT) if _alive(rank1) else None
    assert wrapper.returncode == 1 and "no progress from the other ranks for 4 s" in err, err


def _wait_for_rank(rank: int, under: int, timeout: float = 60) -> int:
    """The pid of the rank that mlx.launch started below process ``under`` (MLX_RANK in its
    environment): never a rank of another test's run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"MLX_RANK={rank}".encode() in environ and b"specmlx" in cmdline:
                if _descends(int(pid), under):
                    return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_per_rank_memory_plan_refuses_a_small_budget(models):
    env = models["env"] | {"SPECMLX_MEMORY_BUDGET": "300kB"}
    done = specmlx(env, "run", "-q", "-n", "8", *TWO, PROMPT)
    assert done.returncode == 1 and not done.stdout
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "its share on each of 2 ranks" in lines[0], done.stderr
    assert "per rank" in lines[0]


def test_bad_hosts_are_one_line_before_anything_starts(models):
    done = specmlx(models["env"], "run", "-q", "--hosts", "alpha,beta", PROMPT)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "IP address" in done.stderr


# ------------------------------------------------------------------ real weights


@pytest.fixture(scope="module")
def wide_smollm2(tmp_path_factory):
    """SmolLM2-135M widened 2x with zero weights (18 query / 6 KV heads; the same logits),
    saved as an MLX dir: a real model that splits over two ranks."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from specmlx.errors import SpecmlxError
    from specmlx.models.loading import load_model
    from specmlx.models.registry import load_registry
    from specmlx.standins.cpu_demo import _save, widen

    try:
        base = load_model(load_registry().resolve("smollm2-135m"))
    except SpecmlxError as e:
        pytest.skip(f"SmolLM2-135M unavailable: {e}")
    root = tmp_path_factory.mktemp("wide")
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(base.model.parameters())}
    wide, args = widen(weights, base.model.args, 2)
    _save(root / "x2", wide, args, base.tokenizer)
    toml = root / "models.toml"
    toml.write_text(
        f'[models.wide]\nsource = "local:{root / "x2"}"\ndtype = "float32"\n'
        '[defaults]\npair = "p"\npair_cpu = "p"\n[pairs.p]\ntarget = "wide"\ndraft = "smollm2-135m-q4"\n'
    )
    env = dict(os.environ, SPECMLX_MODELS=str(toml))
    for name in ("SPECMLX_SERVER", "SPECMLX_MEMORY_BUDGET", "MLX_RANK"):
        env.pop(name, None)
    return env


@pytest.mark.slow
def test_real_weights_two_ranks_equal_one_process(wide_smollm2):
    args = ["run", "--json", "-q", "-n", "24", "-k", "3", "def fibonacci(n):\n    "]
    one, two = specmlx(wide_smollm2, *args), specmlx(wide_smollm2, *args, *TWO)
    assert tokens(two) == tokens(one)
    assert json.loads(two.stdout)["stats"]["accepted"] > 0  # the q4 draft really drafted
    refused = specmlx(wide_smollm2, "run", "-q", "--target", "smollm2-135m", "--draft", "none",
                      *TWO, "x")  # fmt: skip
    assert refused.returncode == 2 and "9 query / 3 KV heads" in refused.stderr


def test_bench_runs_under_two_ranks(models, tmp_path):
    out = tmp_path / "bench.json"
    done = specmlx(
        models["env"], "bench", "-n", "8", "--repeats", "1", "--limit", "1", "-k", "2,auto",
        "--temp", "0", "--compare", "none", "--json", str(out), *TWO,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["environment"]["ranks"] == {"size": 2, "backend": "ring"}
    assert all(row["identical_to_target"] for row in result["rows"])
    assert done.stdout.count("specmlx bench") == 1  # one table (on stdout): rank 0's


def test_serve_over_two_ranks(models):
    """rank 0 serves HTTP and sends each request to rank 1, which runs it in step: the same
    tokens as one process; a client that hangs up stops both ranks at the same round; the
    next request is fine; SIGTERM stops every rank with exit code 0."""
    import httpx

    env = models["env"]
    server = Server(env, *TWO)
    url = server.url
    try:
        body = {"prompt": PROMPT, "max_tokens": 24, "return_tokens": True}
        for extra, args in (
            ({}, []),
            ({"temperature": 0.8, "seed": 5}, ["--temp", "0.8", "--seed", "5"]),
        ):
            got = httpx.post(url + "/v1/completions", json=body | extra, timeout=120).json()
            one = specmlx(env, "run", "--json", "-q", "-n", "24", *args, PROMPT)
            assert got["choices"][0]["token_ids"] == tokens(one)
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 1500, "stream": True}) as r:  # fmt: skip
            assert next(r.iter_lines()).startswith("data: ")
        again = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        greedy = specmlx(env, "run", "--json", "-q", "-n", "24", PROMPT)
        assert again["choices"][0]["token_ids"] == tokens(greedy)
        metrics = httpx.get(url + "/metrics").text
        assert "specmlx_requests_cancelled_total 1" in metrics
    finally:
        code, err = server.stop()
    assert code == 0, err


def test_a_batch_over_two_ranks_gives_each_request_its_one_process_text(models):
    """rank 0 batches concurrent requests and the other rank runs the same batch in step
    (rows joining, a round's k, rows leaving: wire.BatchOps): three requests at once, one
    of them sampled with a seed and one that hangs up halfway, each finished one equal to
    `specmlx run` in one process; the batch did run (/metrics)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    env = models["env"]
    server = Server(env, *TWO, "--max-batch", "4")
    url = server.url
    asks = [
        ({"prompt": PROMPT, "max_tokens": 24}, []),
        ({"prompt": "class A:\n", "max_tokens": 16, "temperature": 0.8, "seed": 9},
         ["--temp", "0.8", "--seed", "9"]),
        ({"prompt": "import os\n", "max_tokens": 20}, []),
    ]  # fmt: skip
    try:

        def complete(body):
            got = httpx.post(url + "/v1/completions", json=body | {"return_tokens": True},
                             timeout=120).json()  # fmt: skip
            return got["choices"][0]["token_ids"]

        def hang_up():
            with httpx.stream("POST", url + "/v1/completions", timeout=60,
                              json={"prompt": PROMPT, "max_tokens": 400, "stream": True}) as r:  # fmt: skip
                lines = r.iter_lines()
                for _ in range(4):
                    next(lines)

        with ThreadPoolExecutor(4) as pool:
            gone = pool.submit(hang_up)
            got = list(pool.map(complete, [body for body, _ in asks]))
            gone.result()
        for (body, args), ids in zip(asks, got, strict=True):
            one = specmlx(env, "run", "--json", "-q", "-n", str(body["max_tokens"]), *args,
                          body["prompt"])  # fmt: skip
            assert ids == tokens(one), body
        metrics = httpx.get(url + "/metrics").text
        rounds = next(float(ln.split()[1]) for ln in metrics.splitlines()
                      if ln.startswith("specmlx_batch_rounds_total"))  # fmt: skip
        assert rounds > 0
    finally:
        code, err = server.stop()
    assert code == 0, err


# ------------------------------------------------------------------ serving ranks fail stop


def _stream_then(server: Server, act) -> list[str]:
    """Start a long streamed completion, call ``act()`` once it streams, return the rest of
    the stream's lines (up to its end or the connection's)."""
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 1900, "stream": True, "num_draft": 3}
    out = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=90) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            act()
            out = [ln for ln in lines if ln]
    except httpx.HTTPError:  # the server went away mid-stream: what came is kept
        pass
    return out


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_follower_that_dies_or_hangs_while_serving_stops_every_rank(models, how):
    """A follower that dies (its socket closes) or hangs (SIGSTOP: nothing to notice but
    silence, bounded by the watchdog): the client's stream ends with a 503-shaped
    rank_failed error and every rank exits non-zero, instead of rank 0 serving on with
    ranks out of step (or hanging forever)."""
    env = models["env"] | {"SPECMLX_RANK_TIMEOUT": "4"}
    server = Server(env, *TWO)
    rank1 = _wait_for_rank(1, server.proc.pid)
    sig = signal.SIGKILL if how == "killed" else signal.SIGSTOP
    try:
        rest = _stream_then(server, lambda: os.kill(rank1, sig))
        code = server.proc.wait(90)
    finally:
        if _alive(rank1):
            os.kill(rank1, signal.SIGCONT)
        if server.proc.poll() is None:
            server.proc.kill()
    err = server.stderr(ended=True)
    assert code != 0, err
    errors = [json.loads(ln[6:]) for ln in rest if ln.startswith("data: {") and '"error"' in ln]
    assert errors and errors[-1]["error"]["code"] == "rank_failed", rest[-3:]
    assert "error:" in err, err
    assert not _alive(rank1) or how == "hung"  # (a stopped process is killed by the launcher)


def test_every_rank_exits_when_the_launcher_goes(models):
    server = Server(models["env"], *TWO)
    ranks = [_wait_for_rank(r, server.proc.pid) for r in (0, 1)]
    launcher = int(Path(f"/proc/{ranks[1]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert launcher != server.proc.pid  # mlx.launch, below specmlx's own wrapper
    try:
        os.kill(launcher, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(_alive(r) and not _zombie(r) for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(r) and not _zombie(r) for r in ranks)
    finally:
        for r in ranks:
            if _alive(r):
                os.kill(r, signal.SIGKILL)
        server.proc.kill()
        server.proc.wait(30)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_api_key_reaches_rank_0_on_stdin_never_a_command_line(models):
    """SPECMLX_API_KEY=K serve --hosts put --api-key K on the command line of mlx.launch and
    of every rank (visible in ps, and sent over ssh)."""
    import httpx

    key = "s3cret-key-for-the-ranks"
    env = models["env"] | {"SPECMLX_API_KEY": key}
    server = Server(env, *TWO)
    try:
        ranks = [_wait_for_rank(r, server.proc.pid) for r in (0, 1)]
        launcher = int(Path(f"/proc/{ranks[1]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        for pid in (launcher, *ranks):
            assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
            assert key.encode() not in Path(f"/proc/{pid}/environ").read_bytes(), pid
        url = server.url + "/v1/models"
        assert httpx.get(url, headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(url).status_code == 401
    finally:
        code, err = server.stop()
    assert code == 0, err


@pytest.mark.parametrize("diverge_at, how", [(-1, ""), (5, ""), (5, "ends")])
def test_k_and_the_lockstep_hash_travel_in_one_collective_a_round(models, diverge_at, how):
    script = Path(__file__).with_name("rank_sync.py")
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
         "--python", sys.executable, str(script), str(diverge_at), *([how] if how else [])],
        env=models["env"] | {"PYTHONPATH": str(Path(__file__).parent.parent)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 2, done.stdout + done.stderr
    for out in lines:
        if diverge_at < 0:
            assert out["ks"] == [3, 1, 4, 1, 5, 9, 2, 6], out  # rank 0's, on both ranks
            # 8 rounds and the last check: one all-gather each, no all-sum
            assert out["calls"] == {"all_gather": 9, "all_sum": 0}, out
            assert out["error"] is None
        else:  # round 5's tokens differ: round 6's k exchange compares them and stops
            assert len(out["ks"]) == diverge_at + 1, out
            assert "different tokens" in out["error"], out


def test_the_worker_hands_a_request_to_the_other_rank_in_two_collectives(models):
    """Over a real ring: rank 1 gets rank 0's request whole (its fields as JSON bytes, after
    the collective that says what comes), then an idle tick and the stop in one each."""
    script = Path(__file__).with_name("rank_sync.py")
    done = subprocess.run(
        [str(Path(sys.executable).parent / "mlx.launch"), "-n", "2", "--backend", "ring",
         "--python", sys.executable, str(script), "request"],
        env=models["env"] | {"PYTHONPATH": str(Path(__file__).parent.parent)},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = {x["rank"]: x for x in map(json.loads, done.stdout.splitlines()) if "rank" in x}
    assert sorted(lines) == [0, 1], done.stdout + done.stderr
    assert lines[1]["equal"] and lines[1]["got"] == lines[0]["sent"]
    assert lines[1]["then"] == [True, None]
    for out in lines.values():  # 2 for the request, 1 for the tick, 1 for the stop
        assert out["calls"] == {"all_gather": 0, "all_sum": 4}, out


def test_the_servers_stoppable_lockstep_keeps_its_own_check_each_round():
    """The server compares each round's tokens before a client sees them (and carries rank
    0's cancel): its lockstep is not carried by the shared k; run's and bench's are."""
    two = World(None, rank=0, size=2)
    served = Lockstep(two, stoppable=True)
    assert SharedK(Script(lambda _last: 1), two, served).lockstep is None and not served.carried
    plain = Lockstep(two)
    assert SharedK(Script(lambda _last: 1), two, plain).lockstep is plain and plain.carried == 2


def test_the_ring_backends_own_lines_are_filtered_and_ours_are_not():
    # MLX's ring writes these to fd 2 itself when a peer dies (seen in CI beside our error)
    for noise in (
        "Sending to socket 4 failed with errno 32",
        "[ring] connection lost",
        "Receiving from socket 5 was closed by the peer",
        "Recv failed with errno=104",
    ):
        assert _RING_NOISE.match(noise), noise
    for ours in ("error: lost the connection to another rank", "error: rank 1: x", "decode 3"):
        assert not _RING_NOISE.match(ours), ours
