"""GGUF tokenizers checked against llama.cpp's own tokenizer test vectors, and our GGUF reader
against the official `gguf` package's writer.

The vectors (ggml-vocab-*.gguf with .inp/.out) come from the llama-cpp-python sdist, fetched once
into a cache (see vocab_files.py); without network and cache those tests skip. llama.cpp's
test-tokenizer-0 tokenizes every input with add_special=false and parse_special=false, so we encode
with add_special_tokens=False (no BOS) and compare the ids.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import regex
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import decoders
from vocab_files import VocabUnavailable, read_vectors, vocab_dir

from specmlx.errors import ModelLoadError
from specmlx.models.gguf import read_gguf_header
from specmlx.models.gguf_tokenizer import gguf_tokenizer

# Every vocabulary with test vectors that we claim, by the file's name (ggml-vocab-<name>.gguf).
SUPPORTED = [
    "llama-spm",  # SentencePiece BPE (Llama 2)
    "phi-3",  # SentencePiece BPE
    "gpt-2",
    "mpt",  # GPT-2's split on the GPT-NeoX vocabulary
    "starcoder",  # every digit on its own, then GPT-2's split
    "refact",
    "command-r",  # 256k tokens: the slowest to load (~3 s)
    "llama-bpe",  # Llama 3
    "qwen2",  # Qwen2 / Qwen2.5(-Coder)
    "deepseek-coder",
    "falcon",
]
# Vocabularies with test vectors that we refuse, with the words of the refusal.
UNSUPPORTED = {
    "deepseek-llm": "pre-tokenizer 'deepseek-llm' is not supported",
    "bert-bge": "tokenizer model 'bert' is not supported",
}

# llama.cpp's splits per pre-tokenizer (src/llama-vocab.cpp, llm_tokenizer_bpe), copied as written
# there: an independent transcription of what our HF pre-tokenizers must do.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA_CPP_SPLITS = {
    "gpt-2": [_GPT2],
    "mpt": [_GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2],
    "llama-bpe": [_LLAMA3],
    "qwen2": [_LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"],
}


@pytest.fixture(scope="module")
def vocabs() -> Path:
    """The directory of llama.cpp's ggml-vocab-* files (downloaded once), or skip."""
    try:
        return vocab_dir()
    except VocabUnavailable as e:
        pytest.skip(f"llama.cpp tokenizer test vectors unavailable: {e}")


def load(vocabs: Path, name: str) -> TokenizerWrapper:
    """Our tokenizer for ggml-vocab-<name>.gguf."""
    path = vocabs / f"ggml-vocab-{name}.gguf"
    return gguf_tokenizer(read_gguf_header(path)[0], path)


# Module-scoped and parametrized: pytest runs all tests of one vocabulary together, so each
# tokenizer is built once and only one (up to ~0.5 GB for 256k tokens) is alive at a time.
@pytest.fixture(scope="module", params=SUPPORTED)
def vocab(request, vocabs) -> tuple[str, TokenizerWrapper, list[tuple[str, list[int]]]]:
    """(name, our tokenizer, llama.cpp's (input, expected ids) pairs) for one vocabulary."""
    name = request.param
    return name, load(vocabs, name), read_vectors(vocabs / f"ggml-vocab-{name}.gguf")


def test_every_vector_file_is_claimed_or_refused(vocabs):
    with_vectors = {
        p.name.removeprefix("ggml-vocab-").removesuffix(".gguf.inp")
        for p in vocabs.glob("ggml-vocab-*.gguf.inp")
    }
    assert with_vectors == set(SUPPORTED) | set(UNSUPPORTED)


def test_encodes_like_llama_cpp(vocab):
    name, tok, vectors = vocab
    assert len(vectors) > 40
    for i, (text, want) in enumerate(vectors):
        got = tok.encode(text, add_special_tokens=False)
        if got != want:  # the first mismatch, with the pieces on both sides
            pytest.fail(
                f"{name} input #{i} {text!r}:\n"
                f"  llama.cpp {want} {tok.convert_ids_to_tokens(want)}\n"
                f"  ours      {got} {tok.convert_ids_to_tokens(got)}"
            )


def test_decodes_back_to_the_input(vocab):
    name, tok, vectors = vocab
    for i, (text, ids) in enumerate(vectors):
        assert tok.decode(ids) == text, f"{name} input #{i} {text!r}"


def test_streaming_detokenizer_gives_the_input_back(vocab):
    # What generation prints. mlx-lm's streaming detokenizers drop the leading space(s) of what
    # they are fed (a generation's first token usually starts with one), so compare without them.
    name, tok, vectors = vocab
    detok = tok.detokenizer
    for i, (text, ids) in enumerate(vectors):
        detok.reset()
        for t in ids:
            detok.add_token(t)
        detok.finalize()
        assert detok.text.lstrip(" ") == text.lstrip(" "), f"{name} input #{i} {text!r}"


def llama_cpp_split(text: str, patterns: list[str]) -> list[str]:
    """llama.cpp's unicode_regex_split: each regex in turn cuts every piece into its matches and
    the text between them."""
    pieces = [text]
    for pattern in patterns:
        cut = []
        for piece in pieces:
            pos = 0
            for m in regex.finditer(pattern, piece):
                cut += [piece[pos : m.start()], m.group()]
                pos = m.end()
            cut.append(piece[pos:])
        pieces = [p for p in cut if p]
    return pieces


def test_pre_tokenizer_splits_like_llama_cpp(vocab):
    # The vectors alone cannot tell some splits apart (Qwen2's vocabulary has no multi-digit
    # tokens, so Llama 3's 1-3 digit groups would pass too): compare the pieces themselves.
    name, tok, vectors = vocab
    if name not in LLAMA_CPP_SPLITS:
        pytest.skip("SentencePiece vocabulary: no regex pre-tokenizer")
    backend = tok._tokenizer.backend_tokenizer
    to_text = decoders.ByteLevel()  # our pieces come out byte-mapped ("Ġ" for a space)
    for i, (text, _) in enumerate(vectors):
        ours = [to_text.decode([p]) for p, _ in backend.pre_tokenizer.pre_tokenize_str(text)]
        want = llama_cpp_split(text, LLAMA_CPP_SPLITS[name])
        assert ours == want, f"{name} input #{i} {text!r}"


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_vocab_is_refused(vocabs, name):
    with pytest.raises(ModelLoadError, match=re.escape(UNSUPPORTED[name])):
        load(vocabs, name)


def test_unknown_pre_tokenizer_is_refused():
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "no-such-pre",
        "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.merges": ["a b"],
    }
    with pytest.raises(ModelLoadError, match="x.gguf: GGUF pre-tokenizer 'no-such-pre' is not"):
        gguf_tokenizer(meta, "x.gguf")


# A byte-level BPE vocabulary small enough to tokenize by hand ("Ġ" is GPT-2's byte for a space).
_TINY_TOKENS = ["<|end|>", "h", "e", "l", "o", "Ġ", "w", "r", "d", "1", "2", "3", "4"]
_TINY_TOKENS += ["he", "ll", "hell", "hello", "12", "34", "123", "Ġworld"]
# "Ġworld" has no merges: only Llama 3's ignore_merges (whole pre-token in the vocab) reaches it.
# "3 4" outranks "12 3": "1234" as one piece gives 12|34, cut into 123|4 first it gives 123|4.
_TINY_MERGES = ["h e", "l l", "he ll", "hell o", "1 2", "3 4", "12 3"]


def write_tiny_vocab(path: Path, pre: str) -> dict:
    """A vocab-only GGUF written by the official `gguf` package; returns the metadata it holds."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(_TINY_TOKENS)
    writer.add_token_types([3] + [1] * (len(_TINY_TOKENS) - 1))
    writer.add_token_merges(_TINY_MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    # One key of each other value type, so the reader meets them all.
    writer.add_uint32("test.u32", 7)
    writer.add_int32("test.i32", -7)
    writer.add_uint64("test.u64", 2**40)
    writer.add_float32("test.f32", 0.5)
    writer.add_bool("test.bool", True)
    writer.add_array("test.floats", [0.25, -1.5])
    writer.add_array("test.strings", ["a", "ünïcode", ""])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": _TINY_TOKENS,
        "tokenizer.ggml.token_type": [3] + [1] * (len(_TINY_TOKENS) - 1),
        "tokenizer.ggml.merges": _TINY_MERGES,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
        "test.u32": 7,
        "test.i32": -7,
        "test.u64": 2**40,
        "test.f32": 0.5,
        "test.bool": True,
        "test.floats": [0.25, -1.5],
        "test.strings": ["a", "ünïcode", ""],
    }


@pytest.mark.parametrize(
    ("pre", "want"),
    [
        ("gpt-2", ["hello", "Ġ", "w", "o", "r", "l", "d", "Ġ", "12", "34"]),
        ("llama-bpe", ["hello", "Ġworld", "Ġ", "123", "4"]),
    ],
)
def test_reads_what_the_gguf_package_writes(tmp_path, pre, want):
    path = tmp_path / "tiny-vocab.gguf"
    written = write_tiny_vocab(path, pre)
    meta, tensors = read_gguf_header(path)
    assert meta == written
    assert tensors == {}
    tok = gguf_tokenizer(meta, path)
    ids = tok.encode("hello world 1234", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == want
    assert tok.decode(ids) == "hello world 1234"
    # llama.cpp starts Llama 3 prompts with BOS when the GGUF does not say; GPT-2 ones without.
    assert (tok.encode("hello")[0] == 0) == (pre == "llama-bpe")
    assert tok.encode("<|end|>hello", add_special_tokens=False) == [0, _TINY_TOKENS.index("hello")]


def test_reads_tensor_shapes_the_gguf_package_writes(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tensors.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tensor("token_embd.weight", np.zeros((5, 3), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(3, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta, tensors = read_gguf_header(path)
    assert meta["general.architecture"] == "llama"
    assert tensors == {"token_embd.weight": ("F32", (5, 3)), "output_norm.weight": ("F16", (3,))}
