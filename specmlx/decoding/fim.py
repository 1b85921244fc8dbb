"""Fill-in-the-middle: the prompt layout each code-model family was trained on, found from the
tokenizer's own special tokens.

A FIM prompt is prefix, suffix, then the middle marker: the model writes the middle and ends
with an end-of-infill token (Code Llama's <EOT>; the others end with their end-of-text or a
file separator). Repo-level context (`input_extra` in llama.cpp's /infill) goes first: as
<repo>/<file_sep> records where the family has those tokens, as plain text otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import BadInput, IncompatiblePair


@dataclass(frozen=True)
class FimLayout:
    """The token strings of one FIM layout."""

    name: str
    prefix: str
    suffix: str
    middle: str
    stops: tuple[str, ...]  # any that the tokenizer has end an infill
    repo: str | None = None
    file_sep: str | None = None


FAMILIES = (
    FimLayout("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>", ("▁<EOT>",)),
    FimLayout(
        "qwen-coder",
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>"),
        "<|repo_name|>",
        "<|file_sep|>",
    ),
    FimLayout(
        "starcoder",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        ("<|endoftext|>", "<file_sep>", "<fim_pad>"),
        "<reponame>",
        "<file_sep>",
    ),
    FimLayout("deepseek-coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ("<|EOT|>",)),
)


@dataclass(frozen=True)
class FimTemplate:
    """One tokenizer's FIM token ids."""

    family: str
    prefix: int
    suffix: int
    middle: int
    stops: tuple[int, ...]
    repo: int | None = None
    file_sep: int | None = None


def fim_template(tokenizer) -> FimTemplate | None:
    """The FIM layout this tokenizer has tokens for, or None (the model cannot infill)."""
    vocab = tokenizer.get_vocab()
    for f in FAMILIES:
        if all(t in vocab for t in (f.prefix, f.suffix, f.middle)):
            stops = tuple(vocab[t] for t in f.stops if t in vocab)
            repo = vocab.get(f.repo) if f.repo and f.file_sep in vocab else None
            sep = vocab.get(f.file_sep) if repo is not None else None
            return FimTemplate(f.name, vocab[f.prefix], vocab[f.suffix], vocab[f.middle], stops, repo, sep)  # fmt: skip
    return None


def require_fim(target_tokenizer, draft_tokenizer=None, name: str = "the target") -> FimTemplate:
    """The target's template; BadInput when it has none, IncompatiblePair when the draft's
    FIM ids differ (it would propose the wrong markers)."""
    mine = fim_template(target_tokenizer)
    if mine is None:
        raise BadInput(
            f"{name} has no fill-in-the-middle tokens, so it cannot infill (Code Llama 34B has "
            "none; the 7B and 13B, StarCoder, Qwen2.5-Coder and DeepSeek-Coder do)"
        )
    if draft_tokenizer is not None and fim_template(draft_tokenizer) != mine:
        raise IncompatiblePair("the draft's fill-in-the-middle tokens differ from the target's")
    return mine


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _encode_inner(tokenizer, text: str) -> list[int]:
    """Text that continues a line: SentencePiece tokenizers prepend a space to every encode,
    which the middle of a file does not have, so encode after a newline and drop it."""
    if not text:
        return []
    head = _encode(tokenizer, "\n")
    ids = _encode(tokenizer, "\n" + text)
    return ids[len(head) :] if ids[: len(head)] == head else ids


@dataclass(frozen=True)
class InfillPieces:
    """An infill prompt's token ids, piece by piece, so a server can cut each to fit its
    context (serving/fitting.py): ``ids()`` lays them out as encode_infill does."""

    template: FimTemplate
    head: list[int]  # [BOS] where the tokenizer adds one
    extra: list[int]  # the other files' records, markers included
    prefix: list[int]
    suffix: list[int]
    middle: list[int]

    def ids(self) -> list[int]:
        """[BOS] [extra] PRE prefix SUF suffix MID middle."""
        t = self.template
        return (
            self.head + self.extra + [t.prefix] + self.prefix + [t.suffix] + self.suffix
            + [t.middle] + self.middle
        )  # fmt: skip


def infill_pieces(
    tokenizer,
    template: FimTemplate,
    prefix: str,
    suffix: str,
    *,
    extra: Sequence[tuple[str, str]] = (),
    middle: str = "",
) -> InfillPieces:
    """The pieces of encode_infill's prompt, each tokenized (the parameters are its)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    probe = list(tokenizer.encode("a"))
    head = [bos] if bos is not None and probe[:1] == [bos] else []
    records: list[int] = []
    if extra and template.repo is not None:
        records += [template.repo] + _encode(tokenizer, "specmlx\n")
        for filename, text in extra:
            records += [template.file_sep] + _encode(tokenizer, f"{filename}\n{text}")
        records += [template.file_sep]
    elif extra:
        records += _encode(tokenizer, "".join(f"{text}\n" for _, text in extra))
    return InfillPieces(
        template, head, records, _encode(tokenizer, prefix), _encode_inner(tokenizer, suffix),
        _encode_inner(tokenizer, middle),
    )  # fmt: skip


def encode_infill(
    tokenizer,
    template: FimTemplate,
    prefix: str,
    suffix: str,
    *,
    extra: Sequence[tuple[str, str]] = (),
    middle: str = "",
) -> list[int]:
    """Token ids of an infill prompt: [BOS] [extra] PRE prefix SUF suffix MID middle.

    tokenizer: the target's; template: from fim_template; prefix, suffix: the text before
    and after the cursor; extra: (filename, text) records of other files, first; middle: text
    already typed after the cursor position's start (llama.cpp's `prompt` for /infill)."""
    pieces = infill_pieces(tokenizer, template, prefix, suffix, extra=extra, middle=middle)
    return pieces.ids()
