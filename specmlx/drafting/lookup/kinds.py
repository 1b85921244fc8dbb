"""How prompt lookup proposes, parsed once where it is named (``--draft``, models.toml, the
bench's systems, a server's settings) into the value the drafter factory reads: suffix
lookup (its tree of continuations), n-gram lookup (the most recent occurrence of the longest
match), or lookahead decoding with its window settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ...errors import BadInput
from .lookahead import LookaheadSize

# --draft's lookup forms and the method each names ("lookahead[:w=W,n=N,g=G]" besides)
NAMES = {"lookup": "suffix", "lookup:suffix": "suffix", "lookup:ngram": "ngram"}
KINDS = "lookup (suffix), lookup:ngram, lookahead[:w=W,n=N,g=G]"


@dataclass(frozen=True)
class LookupKind:
    """How lookup proposes. method: "suffix", "ngram" or "lookahead"; lookahead: the
    window's settings (method "lookahead" only; None: the others)."""

    method: Literal["suffix", "ngram", "lookahead"] = "suffix"
    lookahead: LookaheadSize | None = None

    def __post_init__(self) -> None:
        if self.method not in ("suffix", "ngram", "lookahead"):
            raise BadInput(f"lookup must be one of {KINDS}, got {self.method!r}")
        if (self.method == "lookahead") != (self.lookahead is not None):
            raise BadInput("a lookahead lookup takes a LookaheadSize, the others none")

    @classmethod
    def of(cls, text: str) -> LookupKind:
        """Parse a lookup's name as --draft gives it ("lookup", "lookup:suffix",
        "lookup:ngram", "lookahead", "lookahead:w=W,n=N,g=G"); BadInput naming the kinds
        for anything else."""
        if text in NAMES:
            return cls(NAMES[text])  # type: ignore[arg-type]
        if text == "lookahead" or text.startswith("lookahead:"):
            return cls("lookahead", LookaheadSize.of(text))
        raise BadInput(f"unknown lookup {text!r}: lookup is one of {KINDS}")

    @property
    def is_suffix(self) -> bool:
        """Suffix lookup: the default, which keys no chooser state apart."""
        return self.method == "suffix"

    @property
    def key(self) -> str:
        """The name saved chooser state is keyed by ("suffix", "ngram" or the lookahead
        form: what earlier releases stored)."""
        return str(self.lookahead) if self.lookahead is not None else self.method

    def __str__(self) -> str:
        if self.lookahead is not None:
            return str(self.lookahead)
        return "lookup" if self.is_suffix else f"lookup:{self.method}"


SUFFIX = LookupKind()
NGRAM = LookupKind("ngram")
