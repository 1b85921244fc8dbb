"""A fast Hugging Face tokenizer rebuilt from a GGUF file's metadata: byte-level BPE ("gpt2",
with llama.cpp's pre-tokenizers) or SentencePiece BPE ("llama")."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
)

from .errors import ModelLoadError


def gguf_tokenizer(meta: dict, path: Path | str = "GGUF") -> TokenizerWrapper:
    """A fast HF tokenizer rebuilt from GGUF metadata ("gpt2" byte-level BPE or "llama" SPM)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")

    def tok(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and i < len(tokens) else None

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _bpe_pre_tokenizer(meta.get("tokenizer.ggml.pre"), path)
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


# llama.cpp pre-tokenizer names whose regex first splits every digit on its own.
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def _bpe_pre_tokenizer(pre: str | None, path: Path | str):
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt2", "olmo"):
        return byte_level
    raise ModelLoadError(f"{path}: GGUF pre-tokenizer '{pre}' is not supported")


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
