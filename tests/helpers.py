"""Tiny random-weight mlx-lm llama models, a table model and tokenizers: right for
mechanics, never for speed claims. Shared by the test modules (conftest.py turns some into
fixtures)."""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import openai
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from specmlx.core.stats import KChooser, RoundReport
from specmlx.decoding.engine import Decode, Parts, generate_tokens
from specmlx.drafting.choosing.choosers import AUTO, K
from specmlx.drafting.choosing.tree_size import TreeSize
from specmlx.drafting.lookup.kinds import LookupKind
from specmlx.models import gguf


def make_tiny(seed: int, vocab: int = 64, layers: int = 2, hidden: int = 32, sharpen: float = 1.0):
    """A random llama; ``sharpen`` scales the output head so distributions are peaky."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)
    if sharpen != 1.0:
        model.lm_head.weight = model.lm_head.weight * sharpen
    mx.eval(model.parameters())
    return model


class TableLM(nn.Module):
    """A random second-order language model for tests that need many thousand whole
    generations through the public API: the logits after a token are a (V, V, V) table's row
    for that token and the one before it. It keeps its context in a real mlx-lm KVCache (the
    ids as one-wide keys), so a cache rolled back wrongly hands it a stale previous token and
    changes what it predicts. Its pass is a handful of MLX ops, where a tiny llama's costs
    ~1.5 ms on a CPU (most of it RoPE)."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.0):
        super().__init__()
        self.table = scale * mx.random.normal((vocab, vocab, vocab), key=mx.random.key(seed))

    def make_cache(self) -> list:
        return [KVCache()]

    def __call__(self, x: mx.array, cache: list | None = None) -> mx.array:
        ids = x.astype(mx.float32)[:, None, :, None]  # (B, 1, L, 1): the new ids as keys
        if cache is not None:
            ids, _ = cache[0].update_and_fetch(ids, ids)  # (B, 1, T, 1): every id so far
        seen = ids[:, 0, :, 0].astype(mx.int32)  # (B, T)
        before = mx.concatenate([mx.zeros_like(seen[:, :1]), seen[:, :-1]], axis=1)  # (B, T)
        n = x.shape[1]
        return self.table[before[:, -n:], seen[:, -n:]]  # (B, L, V)


class RowsTableLM(TableLM):
    """TableLM that reads each row at its own length, as a batch's rows are held (a
    BatchKVCache, right-padded, row i's ids in [0, lens[i])); one row in a KVCache reads as
    TableLM does. For the distribution of sequences generated in a batch."""

    def __call__(self, x: mx.array, cache: list | None = None) -> mx.array:
        if cache is None:
            return super().__call__(x)
        B, n = x.shape
        at = mx.array(cache[0].offset).reshape(-1, 1)  # (B or 1, 1): where x's ids go
        ids = x.astype(mx.float32)[:, None, :, None]
        seen, _ = cache[0].update_and_fetch(ids, ids)  # (B, 1, T, 1), rows padded past lens
        seen = seen[:, 0, :, 0].astype(mx.int32)
        padded = mx.concatenate([mx.zeros_like(seen[:, :1]), seen], axis=1)  # id at p: p + 1
        pos = mx.broadcast_to(at + mx.arange(n), (B, n))  # (B, n): x's own positions
        now = mx.take_along_axis(padded, pos + 1, axis=1)
        before = mx.take_along_axis(padded, pos, axis=1)
        return self.table[before, now]  # (B, n, V)


class WindowTableLM(TableLM):
    """TableLM whose context lives in a sliding-window cache of 2 (mlx-lm's RotatingKVCache,
    which specmlx turns into its WindowKVCache): all a second-order model needs, so a prompt
    of a few tokens already runs past the window, and a rollback that loses a key hands it a
    stale previous token."""

    def make_cache(self) -> list:
        return [RotatingKVCache(max_size=2)]


class RecurrentTableLM(TableLM):
    """TableLM with a recurrent state (an ArraysCache), as a Mamba or gated-delta layer keeps
    one: the last id and a running sum of every id (mod 3) that shifts the logits. The state
    cannot be trimmed, only restored, and one left advanced past a rejected draft keeps that
    draft in the sum, which changes what the model predicts from then on."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.0):
        super().__init__(vocab, seed, scale)
        self.mix = scale * mx.random.normal((3, vocab), key=mx.random.key(seed + 1))

    def make_cache(self) -> list:
        return [ArraysCache(size=2)]

    def __call__(self, x: mx.array, cache: list | None = None) -> mx.array:
        ids = x.astype(mx.int32)  # (B, L)
        state = None if cache is None else cache[0]
        held = state is not None and state[0] is not None
        prev = state[0] if held else mx.zeros_like(ids[:, :1])  # (B, 1)
        total = state[1] if held else mx.zeros_like(ids[:, :1])  # (B, 1)
        sums = (total + mx.cumsum(ids, axis=1)) % 3  # (B, L): the state after each id
        before = mx.concatenate([prev, ids[:, :-1]], axis=1)  # (B, L)
        if state is not None:
            state[0], state[1] = ids[:, -1:], sums[:, -1:]
        return self.table[before, ids] + self.mix[sums]  # (B, L, V)


def noisy_tiny_pair():
    """A tiny llama and a draft that is its copy with a noisy head (it agrees often, not
    always, so chains break and a tree's other nodes get their chance)."""
    target = make_tiny(5, vocab=32, layers=2, sharpen=3.0)
    draft = make_tiny(5, vocab=32, layers=2, sharpen=3.0)
    noise = mx.random.normal(draft.lm_head.weight.shape, key=mx.random.key(9))
    draft.lm_head.weight = draft.lm_head.weight + 0.6 * noise
    mx.eval(draft.parameters())
    return target, draft


def count_host_syncs(monkeypatch, count: list[int]) -> None:
    """Add one to count[0] at every way the host waits for MLX (eval, item, tolist, the
    conversions); async_eval only queues work without waiting, so it is not counted."""

    def counting(fn):
        def wrapped(*a, **kw):
            count[0] += 1
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(mx, "eval", counting(mx.eval))
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(mx.array, name, counting(getattr(mx.array, name)))


def syncs_per_round(monkeypatch, k: int = 3):
    """A chooser that always asks for k and, in the list it returns with, (host syncs since
    the round before, that round's report) at each round: count_host_syncs per round."""
    count, counts = [0], []

    def choose(last):
        counts.append((count[0], last))
        count[0] = 0
        return k

    count_host_syncs(monkeypatch, count)
    return choose, counts


CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "import os\nfor i in range(10):\n    print(i, os.getcwd())\n",
    "class Point:\n    x: int = 0\n    y: int = 0\n",
]
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2


FIM_TOKENS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<reponame>"]


def tiny_tokenizer(
    corpus: list[str] | None = None,
    extra_tokens: int = 0,
    vocab_size: int = 320,
    fim: bool = False,
):
    """A byte-level BPE PreTrainedTokenizerFast; `extra_tokens` appends <extra_i> tokens;
    `fim` adds StarCoder's fill-in-the-middle tokens as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus or CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    if extra_tokens:
        tok.add_tokens([f"<extra_{i}>" for i in range(extra_tokens)])
    if fim:
        tok.add_special_tokens({"additional_special_tokens": FIM_TOKENS})
    return tok


def tiny_config(vocab_size: int, **over) -> dict:
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return config | over


def make_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    corpus: list[str] | None = None,
    extra_tokens: int = 0,
    vocab_size: int | None = None,
    fim: bool = False,
    chat_template: str | None = None,
    **config_over,
) -> Path:
    """Save a random tiny llama + tokenizer as an MLX model dir; logits width = tokenizer size."""
    tok = tiny_tokenizer(corpus, extra_tokens, fim=fim)
    if chat_template:
        tok.chat_template = chat_template
    return save_tiny(path, tiny_config(vocab_size or len(tok), **config_over), tok, seed)


def save_tiny(path: Path, config: dict, tokenizer, seed: int) -> Path:
    """A random model of ``config``'s mlx-lm family and ``tokenizer`` saved as an MLX model
    directory, as the hub's repos are laid out."""
    from mlx_lm.utils import save_config, save_model

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(dict(config), path / "config.json")
    tokenizer.save_pretrained(str(path))
    return path


# what `specmlx models build cpu-demo` reports of the pair it built (as JSON): for the tests
# that fake standins.cpu_demo.build_demo (test_cli, test_distill, test_distill_heads)
DEMO_FACTS = json.dumps(
    {
        "target": "/x/target", "draft": "/x/draft", "target_params": 1e9, "draft_params": 1e8,
        "labels": {"target": "wide", "draft": "q4"}, "max_abs_dlogit": 1e-5,
        "draft_agreement": 0.8, "tokens_checked": 96,
    }
)  # fmt: skip


DISTILL_TEXT = (
    "def add(a, b):\n    return a + b\n\n" * 8 + "class Point:\n    x: int\n    y: int\n" * 8
)


def distill_teacher(path: Path, layers: int):
    """A tiny llama of ``layers`` blocks with a real tokenizer, loaded as specmlx loads a
    model, its head sharpened so it has preferences: what the distill tests teach from."""
    from specmlx.models.loading import load_model
    from specmlx.models.registry import load_registry

    loaded = load_model(
        load_registry().resolve(str(make_tiny_model(path, num_hidden_layers=layers)))
    )
    loaded.model.lm_head.weight = loaded.model.lm_head.weight * 4
    mx.eval(loaded.model.parameters())
    return loaded


def distill_data(root: Path) -> Path:
    """Twenty small Python files under ``root`` (two held out by name: a tenth, by hash)."""
    for i in range(20):
        (root / f"f{i}.py").write_text(DISTILL_TEXT.replace("add", f"add{i}"))
    return root


def tiny_pair(root: Path, **model_kw) -> Path:
    """Tiny target (seed 0) and draft (seed 1) under ``root`` and a models.toml making them
    the default pair "tiny" (k = 3, context 2048); returns the toml's path."""
    for name, seed in (("t", 0), ("d", 1)):
        if not (root / name).exists():
            make_tiny_model(root / name, seed=seed, **model_kw)
    toml = root / "models.toml"
    toml.write_text(
        '[defaults]\npair = "tiny"\npair_cpu = "tiny"\ncontext = 2048\n'
        f'[models.tiny-t]\nsource = "local:{root / "t"}"\n'
        f'[models.tiny-d]\nsource = "local:{root / "d"}"\n'
        '[pairs.tiny]\ntarget = "tiny-t"\ndraft = "tiny-d"\nk = 3\n'
    )
    return toml


# ------------------------------------------------------------------ GGUF files

GGML = {"F32": 0, "Q4_0": 2, "Q8_0": 8, "Q5_K": 13, "Q5_0": 6, "type 99": 99}
_TO_GGUF = {v: k for k, v in gguf._BLOCK_NAMES.items()}
_TOP_TO_GGUF = {v: k for k, v in gguf._TOP_NAMES.items()}


def gguf_name(mlx_name: str) -> str:
    base, _, leaf = mlx_name.rpartition(".")
    if base.startswith("model.layers."):
        _, _, n, *rest = base.split(".")
        return f"blk.{n}.{_TO_GGUF['.'.join(rest)]}.{leaf}"
    return f"{_TOP_TO_GGUF[base]}.{leaf}"


def q8_0(x: np.ndarray) -> bytes:
    blocks = x.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    q = np.round(blocks / np.where(d == 0, 1, d)).astype(np.int8)
    rows = [d16.tobytes() + qs.tobytes() for d16, qs in zip(d.astype(np.float16), q, strict=True)]
    return b"".join(rows)


def write_gguf(path: Path, meta: dict, tensors: dict[str, tuple[str, tuple, bytes]]) -> Path:
    """A minimal GGUF v3 writer: scalars, strings, lists; tensors as (type, mlx shape, bytes)."""

    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    def value(v) -> bytes:
        if isinstance(v, bool):
            return struct.pack("<I?", 7, v)
        if isinstance(v, int):
            return struct.pack("<II", 4, v)
        if isinstance(v, float):
            return struct.pack("<If", 6, v)
        if isinstance(v, str):
            return struct.pack("<I", 8) + s(v)
        kind = 8 if isinstance(v[0], str) else 6 if isinstance(v[0], float) else 5
        head = struct.pack("<IIQ", 9, kind, len(v))
        if kind == 8:
            return head + b"".join(s(x) for x in v)
        return head + struct.pack(f"<{len(v)}{'f' if kind == 6 else 'i'}", *v)

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    out += b"".join(s(k) + value(v) for k, v in meta.items())
    offset, blobs = 0, []
    for name, (kind, shape, data) in tensors.items():
        dims = shape[::-1]
        out += s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, GGML[kind], offset)
        pad = b"\0" * (-len(data) % 32)
        blobs.append(data + pad)
        offset += len(data) + len(pad)
    out += b"\0" * (-len(out) % 32)
    path.write_bytes(out + b"".join(blobs))
    return path


def tokenizer_meta(tok) -> dict:
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab = {t: i for t, i in tok.get_vocab().items()}
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [
            3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens
        ],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }


def build_tiny_gguf(tmp_path: Path):
    """(path, reference, meta, tensors) for a tiny llama written as GGUF.

    The projections and embeddings are Q8_0, the norms F32; the reference (rope_traditional,
    like llama.cpp's layout) holds the same Q8_0-rounded weights in float32."""
    tok = tiny_tokenizer()
    config = tiny_config(len(tok), hidden_size=64, rope_traditional=True)
    mx.random.seed(3)
    ref = llama.Model(llama.ModelArgs.from_dict(config))
    tensors, rounded = {}, {}
    for name, w in tree_flatten(ref.parameters()):
        x = np.array(w, dtype=np.float32)
        if x.ndim == 2:
            data = q8_0(x)
            blocks = np.frombuffer(data, dtype=np.uint8).reshape(-1, 34)
            d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
            q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
            rounded[name] = mx.array((q * d).reshape(x.shape))
            tensors[gguf_name(name)] = ("Q8_0", x.shape, data)
        else:
            tensors[gguf_name(name)] = ("F32", x.shape, x.tobytes())
    ref.load_weights(list(rounded.items()), strict=False)
    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.context_length": 256,
        **tokenizer_meta(tok),
    }
    return write_gguf(tmp_path / "tiny.gguf", meta, tensors), ref, meta, tensors


# ------------------------------------------------------------------ k choosers


class Feed:
    """Plays the engine for a chooser: asks for k, then reports the round."""

    def __init__(self, chooser, last=None):
        self.chooser, self.last, self.timed = chooser, last, 0

    def k(self) -> int:
        return self.chooser(self.last)

    def done(self, k, n, round_s, draft_s=None) -> None:
        self.last = RoundReport(k, n, round_s, draft_s)
        self.timed += draft_s is not None


def steady(feed, rounds, accept, draft_s=0.03, verify=lambda k: 0.1 + 0.005 * k):
    """Feed ``rounds`` rounds: each draft accepted with probability ``accept`` (seeded), the
    drafting timed apart on one drafting round in eight, as the engine does. Returns the ks."""
    rng = random.Random(0)
    ks = []
    for _ in range(rounds):
        k = feed.k()
        ks.append(k)
        n = next((i for i in range(k) if rng.random() >= accept), k)  # leading acceptances
        timed = k > 0 and (feed.timed == 0 or rng.random() < 1 / 8)
        feed.done(k, n, draft_s * k + verify(k), draft_s * k if timed else None)
    return ks


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`specmlx serve ARGS` in its own process on a free loopback port, with ``env``. Its
    stderr is read as it comes (``stderr()``: so far), so a server that logs every request
    never fills the pipe and blocks."""

    def __init__(self, env: dict, *args: str):
        import threading

        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "specmlx", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._err: list[bytes] = []
        self._readers = [
            threading.Thread(target=self._read, args=(pipe, keep), daemon=True)
            for pipe, keep in ((self.proc.stderr, self._err), (self.proc.stdout, []))
        ]
        for r in self._readers:
            r.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._readers[0].join(10)
                raise RuntimeError(f"server exited: {self.stderr()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)
        raise RuntimeError("server did not start")

    @staticmethod
    def _read(pipe, keep: list) -> None:
        for line in iter(pipe.readline, b""):
            keep.append(line)

    def stderr(self, ended: bool = False) -> str:
        """What the server has written to stderr so far (``ended``: it has exited, so all
        of it, once the readers have it)."""
        if ended:
            for r in self._readers:
                r.join(10)
        return b"".join(self._err).decode()

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        return self.proc.returncode, self.stderr(ended=True)


class Script(KChooser):
    """A test's k schedule as a chooser: ``fn(last) -> k``; its ``plain_next`` attribute,
    when it has one, is the chooser's."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, last):
        return self.fn(last)

    def plain_next(self) -> bool:
        return getattr(self.fn, "plain_next", lambda: False)()


_DECODE = {f.name for f in fields(Decode)}
_PARTS = {f.name for f in fields(Parts)}


def generate(target, draft, prompt, *, k=4, **settings):
    """generate_tokens with its settings as keywords, by the names of Decode's and Parts'
    fields; ``k`` is a k setting (an int, "auto", a K) or a chooser (a bare function is
    taken as a Script), and ``tree`` a tree setting (an int, "auto", "expand:N", a
    TreeSize), ``lookup`` (a bool or a LookupKind) with ``lookup_by`` (how: "suffix",
    "ngram" or a lookahead form): parsed here, this keyword API's edge, as the CLI parses
    its options."""
    chooser = None
    by = settings.pop("lookup_by", "suffix")
    if settings.get("lookup") is True:
        settings["lookup"] = LookupKind.of("lookup:" + by if by in ("suffix", "ngram") else by)
    elif settings.get("lookup") is False:
        settings["lookup"] = None
    if not isinstance(k, (int, str, K)):
        chooser, k = (k if isinstance(k, KChooser) else Script(k)), AUTO
    unknown = set(settings) - _DECODE - _PARTS
    assert not unknown, unknown
    if "tree" in settings:
        settings["tree"] = TreeSize.of(settings["tree"])
    decode = Decode(k=K.of(k), **{n: v for n, v in settings.items() if n in _DECODE})
    parts = Parts(chooser=chooser, **{n: v for n, v in settings.items() if n in _PARTS})
    return generate_tokens(target, draft, prompt, decode, parts)


def served_head_equals_no_draft(tmp_path: Path, target: Path, draft: str, k: int) -> None:
    """The official openai client against `specmlx serve --target TARGET --draft DRAFT` (a
    head over the target's hidden states): greedy text as with no draft, a request that
    extends an earlier one starts on its caches (the target's and the head's), and the head
    drafted. draft: "kind:PATH", reported as "kind:NAME" (the path's last part)."""
    env = dict(os.environ, SPECMLX_HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "x"))
    for name in ("SPECMLX_MODELS", "SPECMLX_SERVER", "SPECMLX_API_KEY", "SPECMLX_MEMORY_BUDGET"):
        env.pop(name, None)
    s = Server(env, "--target", str(target), "--draft", draft, "-k", str(k), "-q")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)

        def complete(prompt, **body):
            return client.completions.create(model="t", prompt=prompt, max_tokens=16,
                                             temperature=0, extra_body=body)  # fmt: skip

        complete("def add(a, b):\n")
        got = complete("def add(a, b):\n    return")
        plain = complete("def add(a, b):\n    return", draft="none")
        spec = got.model_extra["specmlx"]
        assert got.choices[0].text == plain.choices[0].text
        kind, _, path = draft.partition(":")
        assert spec["drafter"] == f"{kind}:{Path(path).name}" and spec["drafted"] > 0, spec
        assert spec["cached_tokens"] > 0, spec
    finally:
        code, err = s.stop()
    assert code == 0 and "Traceback" not in err, err
