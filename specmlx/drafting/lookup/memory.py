"""Prompt lookup with memory: propose what followed earlier occurrences of the context's
tail, found in the context itself or in a bounded store of recent outputs (the lookup
memory), as llama.cpp's ngram cache and SuffixDecoding do. Two ways to read them: suffix
lookup (``speculate``: a tree of every occurrence's continuation, weighed by frequency and
recency, suffix.py) and n-gram lookup (``find``: the continuation of the most recent
occurrence of the longest match, the lookup before suffix trees).

Lookup proposals go through the same verification as a draft model's, so whatever the index
or the store holds (stale, from another prompt, corrupt on disk) can change how many tokens a
target pass yields, never which tokens come out.

The store lives under $SPECMLX_HOME/lookup/<tokenizer fingerprint>/: one small file per
remembered output, written atomically under a unique name, so concurrent runs and servers
never write the same file; the newest files up to ``max_tokens`` are read, older ones are
deleted by whoever notices them first. Writing is best effort: a read-only home costs one
warning line. A server's requests share one store (its index is read, never changed, by a
proposal; an output joins it when its request ends).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ...paths import Warn, atomic_write, specmlx_home
from .suffix import MAX_MATCH, MAX_NGRAM, SEP, Speculation, SuffixIndex

MEMORY_TOKENS = 65_536  # tokens the store keeps, newest first
MIN_REMEMBER = 8  # outputs shorter than this are not worth a file
_MAGIC = b"specmlx-lookup-1\n"


def lookup_propose(history: Sequence[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Prompt lookup over ``history`` alone, in one call: the continuation of the most recent
    earlier occurrence of its longest suffix (max_ngram tokens down to 1); at most k tokens,
    [] when nothing matches."""
    if k <= 0:
        return []
    index = SuffixIndex(max_ngram)
    index.extend(history)
    n, end = index.match(history)
    return index.after(end, k) if n else []


class LookupMemory:
    """A bounded store of recent outputs for one tokenizer, indexed for lookup.

    directory: where its files live (None: memory only, nothing read or written; the bench
    uses that); max_tokens: how many tokens it keeps, newest first; vocab_size: ids at or
    above it make a file invalid (another tokenizer's); warn: gets one line when a write
    fails (once per store); max_n: the longest n-gram indexed.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        max_tokens: int = MEMORY_TOKENS,
        vocab_size: int | None = None,
        warn: Warn | None = None,
        max_n: int = MAX_NGRAM,
    ):
        self.directory, self.max_tokens, self.vocab_size = directory, max_tokens, vocab_size
        self.warn, self.max_n = warn, max_n
        self.docs: list[list[int]] = []  # oldest first
        self.index = SuffixIndex(max_n)
        self._failed = False
        if directory is not None:
            self.docs = self._read()
        self._reindex()

    @staticmethod
    def directory_for(tokenizer) -> Path:
        """$SPECMLX_HOME/lookup/<fingerprint>: the store for outputs of ``tokenizer`` (an
        mlx-lm TokenizerWrapper or a Hugging Face tokenizer)."""
        return specmlx_home() / "lookup" / tokenizer_fingerprint(tokenizer)

    @property
    def size(self) -> int:
        """Tokens remembered."""
        return sum(len(d) for d in self.docs)

    def add(self, tokens: Sequence[int]) -> None:
        """Remember one output: index it now, and write it to the store (best effort)."""
        doc = [int(t) for t in tokens]
        if len(doc) < MIN_REMEMBER or not self._valid(doc):
            return
        self.docs.append(doc)
        if self.size > self.max_tokens:
            self.docs = _newest(self.docs, self.max_tokens)
            self._reindex()
        else:
            self.index.extend([*doc, SEP])
        if self.directory is not None:
            self._write(doc)

    def propose(self, tail: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, tokens): the longest match of ``tail`` in memory and up to k tokens after it."""
        n, end = self.index.match(tail)
        return (n, self.index.after(end, k)) if n else (0, [])

    def _valid(self, doc: list[int]) -> bool:
        return all(0 <= t < (self.vocab_size or 2**32) for t in doc)

    def _reindex(self) -> None:
        self.index = SuffixIndex(self.max_n)
        for doc in self.docs:
            self.index.extend([*doc, SEP])

    def _files(self) -> list[Path]:
        """The store's files, newest first (names start with a nanosecond timestamp)."""
        try:
            return sorted(self.directory.glob("*.tok"), reverse=True)
        except OSError:
            return []

    def _read(self) -> list[list[int]]:
        """The newest valid files up to max_tokens, oldest first; older files are deleted."""
        docs, total, skipped = [], 0, 0
        files = self._files()
        for i, path in enumerate(files):
            doc = _load(path)
            if doc is None or not self._valid(doc):
                skipped += 1  # unreadable, truncated, or another tokenizer's: only speed is lost
                continue
            if total + len(doc) > self.max_tokens:
                _delete(files[i:])  # beyond the cap: whoever sees them first deletes them
                break
            docs.append(doc)
            total += len(doc)
        if skipped and self.warn is not None:
            where = self.directory
            self.warn(f"skipped {skipped} damaged or foreign file(s) in the lookup memory {where}")
        return docs[::-1]

    def _write(self, doc: list[int]) -> None:
        name = f"{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}.tok"
        data = _MAGIC + np.asarray(doc, dtype="<u4").tobytes()
        try:
            atomic_write(self.directory / name, data)
        except OSError as e:
            if self.warn is not None and not self._failed:
                self.warn(
                    f"could not save lookup memory under {self.directory} "
                    f"({e.strerror or e}); continuing without saving"
                )
            self._failed = True
            return
        _delete(self._files()[len(self.docs) + 64 :])  # well past the cap: prune


def _delete(paths: list[Path]) -> None:
    """Best effort: another process may have deleted them, or the store may be read-only."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            return


def _newest(docs: list[list[int]], cap: int) -> list[list[int]]:
    """The newest docs whose total length fits in ``cap``, oldest first."""
    out, total = [], 0
    for doc in reversed(docs):
        if total + len(doc) > cap:
            break
        out.append(doc)
        total += len(doc)
    return out[::-1]


def _load(path: Path) -> list[int] | None:
    """One remembered output, or None for a file that is not one of ours or is damaged."""
    try:
        raw = path.read_bytes()
    except OSError:
        return None  # deleted by another process meanwhile, or unreadable
    body = raw[len(_MAGIC) :]
    if not raw.startswith(_MAGIC) or len(body) % 4:
        return None
    return np.frombuffer(body, dtype="<u4").astype(np.int64).tolist()


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's vocabulary: outputs are shared by every model that
    tokenizes the same way, and never with one that does not."""
    vocab = tokenizer.get_vocab()
    text = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class Lookup:
    """One generation's lookup: an index over its context, and optionally a memory.

    The longer match wins; on a tie the context's, since it is this very text. A list
    ``context`` is kept by reference, not copied (the engine's own: it appends each round's
    tokens and calls ``sync``); ``extend`` appends to it. The output is remembered at the end.
    """

    def __init__(self, context: Sequence[int], memory: LookupMemory | None = None):
        self.memory = memory
        self.pool: SuffixIndex | None = None  # lookahead's n-grams (lookahead.py), if any
        tokens = context if isinstance(context, list) else list(context)
        self.index = SuffixIndex(memory.max_n if memory is not None else MAX_NGRAM, tokens)
        self.start = len(self.index.tokens)  # where the output begins

    def extend(self, new: Sequence[int]) -> None:
        """Tokens that joined the context."""
        self.index.extend(new)

    def sync(self) -> None:
        """Index the tokens the context's owner appended since the last call."""
        self.index.sync()

    def find(self, k: int) -> tuple[int, list[int]]:
        """(n, tokens): up to k tokens to verify next and the length of the n-gram match
        they follow; (0, []) when neither the context nor memory matches."""
        if k <= 0:
            return 0, []
        tail = self.index.tokens[-self.index.max_n :]
        n, end = self.index.match(tail)
        if self.memory is not None:
            m, tokens = self.memory.propose(tail, k)
            if m > n:
                return m, tokens
        return (n, self.index.after(end, k)) if n else (0, [])

    def propose(self, k: int) -> list[int]:
        """Up to k tokens to verify next; [] when nothing matches."""
        return self.find(k)[1]

    def speculate(self, depth: int, budget: int) -> Speculation:
        """Suffix lookup (suffix.py): the best-scoring proposal tree from the context, from
        memory and from lookahead's pool, at most ``budget`` nodes, none deeper than
        ``depth``; on a tie the context's, since it is this very text."""
        tail = self.index.tokens[-MAX_MATCH:]
        spec = self.index.speculate(tail, depth, budget)
        for other in (self.memory.index if self.memory else None, self.pool):
            if other is not None:
                found = other.speculate(tail, depth, budget)
                spec = found if found.score > spec.score else spec
        return spec

    def remember(self) -> None:
        """Store this generation's output in memory (if there is one)."""
        if self.memory is not None:
            self.memory.add(self.index.tokens[self.start :])
