"""The benchmark's data: the prompt sets and editing sequences it runs (built in, or JSONL),
and the records of what runs (System, Run, BenchSettings)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from ..core.acceptance import DEFAULT_VERIFY
from ..drafting.choosing.choosers import AUTO, K
from ..drafting.choosing.tree_size import OFF, TreeSize
from ..errors import BadInput, parsed

NGRAM = "lookup:ngram"  # the drafter of rows whose lookup reads the latest match (no trees)
MEMORY = " + memory"  # the drafter suffix of rows whose lookup also searches a lookup memory

STOP = " + stop"  # the drafter suffix of auto rows whose draft model stops per token


@dataclass(frozen=True)
class System:
    """One configuration under test."""

    system: str  # "target-only", "specmlx", "mlx-lm"
    drafter: str  # "none", the draft alias, "lookup", NGRAM, "<draft> + lookup", "... + memory"
    k: K
    verify: str = DEFAULT_VERIFY  # specmlx's acceptance rule for sampled rounds
    tree: TreeSize = OFF  # specmlx's token trees (its draft model's rows)

    def __post_init__(self) -> None:
        parsed(self.k, K, "k"), parsed(self.tree, TreeSize, "tree")

    @property
    def label(self) -> str:
        # the default rule goes unnamed: a row's label (which also keys its saved k chooser)
        # is the same whether or not --verify named the rule
        rule = "" if self.verify == DEFAULT_VERIFY else f" verify={self.verify}"
        tree = "" if self.tree.off else f" tree={self.tree}"
        return f"{self.system} {self.drafter} k={self.k}{rule}{tree}"


@dataclass
class Run:
    """One generation: what came out and how long the decode part took."""

    label: str
    prompt: str
    temperature: float
    repeat: int
    tokens: list[int]
    decoded: int  # tokens after the first target pass
    decode_s: float
    drafted: int
    accepted: int
    same: str | None = None  # greedy: "identical", "near-tie" or "diverged" vs target-only
    # per draft position: rounds that verified it with all before accepted, and accepted it
    depth_tried: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    # token trees (stats.Stats): passes that verified a tree, and side leaves by sibling rank
    # tried where the chain was rejected, and kept
    tree_rounds: int = 0
    rank_tried: list[int] = field(default_factory=list)
    rank_kept: list[int] = field(default_factory=list)


@dataclass
class BenchSettings:
    ks: list[K] = field(default_factory=lambda: [K(1), K(2), K(4), K(8), AUTO])
    temps: list[float] = field(default_factory=lambda: [0.0, 0.8])
    top_p: float = 0.95
    max_tokens: int = 128
    repeats: int = 3
    compare_mlx_lm: bool = True
    lookup: bool = False  # add lookup and hybrid rows
    memory: bool = False  # with lookup: add rows that also look up in a lookup memory
    draft_stop: bool = False  # add auto rows whose draft model stops per token
    seed: int = 0
    verifies: list[str] = field(default_factory=lambda: [DEFAULT_VERIFY])  # rows per rule
    trees: list[TreeSize] = field(default_factory=lambda: [OFF])  # draft/head rows per setting
    lookaheads: list[str] = field(default_factory=list)  # lookahead rows ("lookahead[:...]")

    def __post_init__(self) -> None:
        for k in self.ks:
            parsed(k, K, "ks")
        for tree in self.trees:
            parsed(tree, TreeSize, "trees")


def read_jsonl(path: str | None, builtin: str, what: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of the JSONL file ``path``, or of
    the packaged data/``builtin`` when path is None; ``what`` names it in errors."""
    try:
        text = (
            Path(path).read_text(encoding="utf-8")
            if path
            else resources.files("specmlx").joinpath(f"data/{builtin}").read_text(encoding="utf-8")
        )
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(
            f"cannot read {what} {path}: {e.strerror if isinstance(e, OSError) else e}"
        ) from None
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}:{i}: not JSON ({e.msg})") from None


def load_prompts(path: str | None, kind: str = "all") -> list[dict]:
    """The packaged code prompts, or any JSONL of {"prompt": ...}; ``kind`` filters by "kind".
    A row with "chat": true is an instruction, sent through the tokenizer's chat template."""
    rows = []
    for i, row in read_jsonl(path, "prompts.jsonl", "prompts"):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise BadInput(f'{path}:{i}: expected an object with a non-empty "prompt" string')
        row.setdefault("id", f"p{i}")
        if kind == "all" or row.get("kind", "code") == kind:
            rows.append(row)
    if not rows:
        raise BadInput(
            f"no prompts{'' if kind == 'all' else f' of kind {kind!r}'} in {path or 'the built-in set'}"
        )
    return rows


EDIT_ASK = (
    "Rewrite this code with {edit} (everything else unchanged). "
    "Reply with the complete rewritten code only.\n\n```{lang}\n{file}\n```"
)


def load_sequences(path: str | None = None) -> list[dict]:
    """Editing sequences: JSONL rows {"id", "lang", "file", "edits": [...]}; default: the
    built-in ones (data/edit_sequences.jsonl)."""
    rows = []
    for i, row in read_jsonl(path, "edit_sequences.jsonl", "edit sequences"):
        edits = row.get("edits") if isinstance(row, dict) else None
        if not isinstance(edits, list) or not edits or not isinstance(row.get("file"), str):
            raise BadInput(f'{path}:{i}: expected an object with "file" and a list of "edits"')
        row.setdefault("id", f"s{i}")
        row.setdefault("lang", "")
        rows.append(row)
    return rows


def edit_step(seq: dict, step: int, file: str) -> dict:
    """The prompt row (a chat instruction) for edit number ``step`` of ``seq`` on ``file``."""
    ask = EDIT_ASK.format(edit=seq["edits"][step], lang=seq["lang"], file=file.rstrip("\n"))
    return {"id": f"{seq['id']}-{step + 1}", "prompt": ask, "chat": True}


def code_of(text: str) -> str:
    """The code in a reply: its first fenced block (to the end when the fence is never
    closed), else the whole reply."""
    start = text.find("```")
    if start < 0:
        return text.strip("\n") + "\n"
    body = text[start + 3 :]
    body = body[body.find("\n") + 1 :] if "\n" in body else ""
    end = body.find("```")
    return (body if end < 0 else body[:end]).strip("\n") + "\n"


def runs_at(system: System, temp: float, s: BenchSettings) -> bool:
    """Whether ``system`` runs at ``temp``: greedy decoding is the same under both rules, so
    block rows are sampled only, unless there is no token-wise row to stand for them."""
    block = system.system == "specmlx" and system.verify == "block"
    return not (block and temp == 0 and "token" in s.verifies)
