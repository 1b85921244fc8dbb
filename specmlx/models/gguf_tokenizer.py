"""A fast Hugging Face tokenizer rebuilt from a GGUF file's metadata: byte-level BPE ("gpt2",
with llama.cpp's GPT-2, StarCoder, Llama 3, Qwen2, DeepSeek-Coder and Falcon pre-tokenizers) or
SentencePiece BPE ("llama"). tests/test_gguf_tokenizer.py checks them on llama.cpp's vectors."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)

from ..errors import ModelLoadError


def gguf_tokenizer(meta: dict, path: Path | str = "GGUF") -> TokenizerWrapper:
    """A fast HF tokenizer rebuilt from GGUF metadata ("gpt2" byte-level BPE or "llama" SPM)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    family = _pre_family(meta.get("tokenizer.ggml.pre"), path) if kind == "gpt2" else None
    # llama.cpp's defaults when the key is absent: SPM and Llama 3 vocabularies start with BOS.
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama" or family == "llama3")

    def tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and i < len(tokens) else None

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        # Llama 3 takes a pre-token found whole in the vocab as is, before any merge (as
        # llama.cpp's ignore_merges and the tokenizer.json's "ignore_merges": true do).
        bpe = models.BPE(
            vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=family == "llama3"
        )
        backend = Tokenizer(bpe)
        backend.pre_tokenizer = _bpe_pre_tokenizer(family)
        backend.decoder = decoders.ByteLevel()
        detok = BPEStreamingDetokenizer
    elif kind == "llama":
        backend, detok = _spm_backend(meta, vocab, tok("unknown")), SPMStreamingDetokenizer
    else:
        raise ModelLoadError(f"{path}: GGUF tokenizer model '{kind}' is not supported")
    # Control and user-defined tokens are matched whole, never split by BPE.
    special = [t for t, kind_ in zip(tokens, types, strict=False) if kind_ in (3, 4)]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    bos = tok("bos")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=tok("eos"),
        unk_token=tok("unknown"),
        pad_token=tok("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    if detok is SPMStreamingDetokenizer:
        trim = meta.get("tokenizer.ggml.add_space_prefix", True)
        return TokenizerWrapper(hf, partial(SPMStreamingDetokenizer, trim_space=trim))
    return TokenizerWrapper(hf, detok)


# llama.cpp's pre-tokenizer names (tokenizer.ggml.pre, src/llama-vocab.cpp), grouped by the
# regexes llama.cpp splits with; each family is rebuilt below as the models' own tokenizer.json does.
_PRE_FAMILIES = {
    "gpt2": "default gpt2 gpt-2 phi-2 mpt olmo",
    "digits": "starcoder refact command-r smollm codeshell exaone minerva-7b",
    "llama3": "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
    "qwen2": "qwen2 deepseek-r1-qwen megrez stablelm2",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
}
_FAMILY = {name: family for family, names in _PRE_FAMILIES.items() for name in names.split()}
# Llama 3's split (tokenizer.json): contractions, letters with one leading non-letter, 1-3 digits,
# punctuation runs with their trailing newlines, then whitespace. Qwen2 differs only in single digits.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# DeepSeek-Coder isolates, in turn: newlines, letter runs, punctuation runs, CJK runs, then digits.
_DEEPSEEK_CODER_SPLITS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+")
# Falcon isolates punctuation runs before GPT-2's split, and cuts digit runs into threes after it.
_FALCON_PUNCT, _FALCON_DIGITS = r"[\p{P}\$\+<=>\^~\|`]+", "[0-9][0-9][0-9]"


def _pre_family(pre: str | None, path: Path | str) -> str:
    """The pre-tokenizer family of a tokenizer.ggml.pre name; ModelLoadError when unknown."""
    # GGUFs older than the key (or converted from an unrecognised tokenizer) say nothing or
    # "default": llama.cpp then warns and uses a split of its own; GPT-2's is our guess.
    if pre is None:
        return "gpt2"
    if pre not in _FAMILY:
        raise ModelLoadError(f"{path}: GGUF pre-tokenizer '{pre}' is not supported")
    return _FAMILY[pre]


def _bpe_pre_tokenizer(family: str):
    """The HF pre-tokenizer of a family: regex splits, then the byte-to-unicode mapping."""
    from tokenizers import Regex, pre_tokenizers

    def split(pattern: str):
        return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)

    # ByteLevel's own regex is GPT-2's; families with their own splits map bytes only.
    gpt2_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    digits = pre_tokenizers.Digits(individual_digits=True)  # every Unicode digit on its own
    steps = {
        "gpt2": [gpt2_bytes],
        "digits": [digits, gpt2_bytes],
        "llama3": [split(_LLAMA3_SPLIT), bytes_only],
        "qwen2": [split(_QWEN2_SPLIT), bytes_only],
        "deepseek-coder": [*map(split, _DEEPSEEK_CODER_SPLITS), digits, bytes_only],
        "falcon": [split(_FALCON_PUNCT), gpt2_bytes, split(_FALCON_DIGITS)],
    }[family]
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _spm_backend(meta: dict, vocab: dict[str, int], unk: str | None):
    """SentencePiece BPE as HF does it: merges ranked by the merged piece's score."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(vocab)
    merges = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((-scores[i], vocab[left], vocab[right], left, right))
    merges.sort()
    backend = Tokenizer(
        models.BPE(
            vocab, [(m[3], m[4]) for m in merges], unk_token=unk, fuse_unk=True, byte_fallback=True
        )
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend
