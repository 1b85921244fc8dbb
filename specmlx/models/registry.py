"""Read and validate models.toml: model aliases, target/draft pairs and defaults.

pydantic validates each raw TOML table against a schema (_FileTable and the tables in it):
the keys a table may have, their types taken strictly (context = "4096" is refused, not
coerced; 1 is not a bool), allowed values (dtype, build, context > 0, k >= 0 or "auto") and
required keys. Kept by hand, as pydantic cannot do them or does them worse: (1) the message.
TOML parsers keep no positions, so _schema_error turns the first of pydantic's errors into one
line naming file:line (_line_of finds the line from the error's loc); pydantic's multi-line
report names neither. (2) Checks on parsed values or across files: a source's kind and shape
(_parse_source, shared with Registry.resolve for names given on the command line), quantize /
keep_quantized against that kind, pairs naming known models and [defaults] naming known pairs
(known only once all files are merged), did-you-mean hints. The parsed result stays the frozen
dataclasses ModelSpec/PairSpec used everywhere else.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..drafting.choosing.choosers import AUTO, K
from ..drafting.choosing.tree_size import AUTO as TREE_AUTO
from ..drafting.choosing.tree_size import TREE_MAX, TreeSize
from ..drafting.self_draft import is_self
from ..errors import BadInput, RegistryError, UnknownModel
from ..paths import expand_path

DTYPES = ("float16", "bfloat16", "float32", "auto")
KINDS = ("hf", "local", "gguf", "wheel")
# drafts a pair may name that are not models: none, prompt lookup, the target's own MTP head
MTP = "mtp"
DRAFT_WORDS = ("none", "lookup", MTP)
# heads over the target's hidden states named as kind:PATH|ALIAS (drafting.heads.eagle3, .dflash,
# .medusa)
HEAD_KINDS = ("eagle3", "dflash", "medusa")
BUILDS = (
    "cpu-demo",
    "cpu-distilled",
    "cpu-eagle3",
)  # stand-ins that `specmlx models build` knows how to make
_HF_REPO = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")
WHEEL_RE = re.compile(r"^([\w.-]+)==([\w.!+-]+)#(.+)$")


def head_of(draft: str | None) -> tuple[str, str] | None:
    """A draft that is a head over the target's hidden states, as (kind, where): ("mtp", "")
    for the target's own MTP head, ("eagle3", PATH|ALIAS) for ``eagle3:PATH|ALIAS`` (and so
    for ``dflash:``); None for a draft model or no draft. BadInput for ``eagle3:`` with
    nothing after it."""
    if draft == MTP:
        return MTP, ""
    kind, colon, where = (draft or "").partition(":")
    if not colon or kind not in HEAD_KINDS:
        return None
    if not where.strip():
        raise BadInput(f"--draft {kind}: needs the head after the colon ({kind}:PATH or an alias)")
    return kind, where.strip()


class _Table(BaseModel):
    """A raw TOML table: no unknown keys and no coercion between types."""

    model_config = ConfigDict(extra="forbid", strict=True)


class _QuantizeTable(_Table):
    bits: int = 4
    group_size: int = 64


class _ModelTable(_Table):  # [models.ALIAS]; "expected one of" lists the keys in this order
    source: str
    dtype: Literal[DTYPES] = "auto"
    quantize: _QuantizeTable | None = None
    keep_quantized: bool = False
    context: PositiveInt | None = None
    label: str = ""
    build: Literal[BUILDS] | None = None
    chat_template: str | None = None


class _PairTable(_Table):  # [pairs.NAME]
    target: str
    draft: str
    k: int | str = "auto"
    tree: int | str = "auto"

    @field_validator("tree")
    @classmethod
    def _tree_setting(cls, tree: int | str) -> int | str:
        try:
            TreeSize.of(tree)  # (the one check of a tree setting)
        except BadInput:
            raise ValueError(f'must be "off", "auto" or 1 to {TREE_MAX}') from None
        return tree

    @field_validator("k")
    @classmethod
    def _k_or_auto(cls, k: int | str) -> int | str:
        try:
            K.of(k)  # (the one check of a k setting)
        except BadInput:
            raise ValueError('must be >= 0 or "auto"') from None
        return k


class _DefaultsTable(_Table):  # [defaults]
    pair: str | None = None
    pair_cpu: str | None = None
    context: PositiveInt = 4096


class _FileTable(_Table):  # one models.toml
    models: dict[str, _ModelTable] = Field(default_factory=dict)
    pairs: dict[str, _PairTable] = Field(default_factory=dict)
    defaults: _DefaultsTable = Field(default_factory=_DefaultsTable)


@dataclass(frozen=True)
class Quantize:
    """Affine quantization applied at load time."""

    bits: int = 4
    group_size: int = 64


@dataclass(frozen=True)
class ModelSpec:
    """One loadable model. `ref` is the source without its `kind:` prefix."""

    alias: str
    kind: str
    ref: str
    revision: str | None = None
    dtype: str = "auto"
    quantize: Quantize | None = None
    keep_quantized: bool = False
    context: int | None = None
    label: str = ""
    build: str | None = None  # the builder that makes it: `specmlx models build NAME`
    # a Jinja chat template file for a tokenizer that has none (a GGUF without
    # tokenizer.chat_template), as llama.cpp's --chat-template-file; it replaces none
    chat_template: str | None = None

    @property
    def source(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"{self.kind}:{self.ref}{rev}"

    @property
    def identity(self) -> str:
        """Everything that changes the weights as loaded: source and revision, dtype,
        quantization and keep_quantized. Probes, adaptive-k state and quantized copies are
        keyed by it (loading adds the files' commit or size and mtime: Loaded.identity)."""
        q = f"q{self.quantize.bits}g{self.quantize.group_size}" if self.quantize else "q-"
        return f"{self.source}|{self.dtype}|{q}|kq={int(self.keep_quantized)}"

    @property
    def path(self) -> Path:
        """The expanded local path (local: and gguf: sources)."""
        return expand_path(self.ref)


@dataclass(frozen=True)
class PairSpec:
    name: str
    target: str
    draft: str
    k: K = AUTO
    tree: TreeSize = TREE_AUTO


@dataclass
class Defaults:
    pair: str | None = None
    pair_cpu: str | None = None
    context: int = 4096


@dataclass
class Registry:
    """All aliases and pairs after merging the shipped, user and $SPECMLX_MODELS files."""

    models: dict[str, ModelSpec] = field(default_factory=dict)
    pairs: dict[str, PairSpec] = field(default_factory=dict)
    defaults: Defaults = field(default_factory=Defaults)
    files: list[Path] = field(default_factory=list)

    def resolve(self, name: str) -> ModelSpec:
        """An alias, a local model dir or .gguf file, a `kind:` source, or an hf owner/repo."""
        if name in self.models:
            return self.models[name]
        path = expand_path(name)
        if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
            kind = "gguf" if path.is_file() else "local"
            return ModelSpec(alias=path.name, kind=kind, ref=str(path.resolve()))
        kind, _, rest = name.partition(":")
        if kind in KINDS and rest:
            try:
                return _parse_source(name.strip(), alias=_alias_for(rest), fields={})
            except ValueError as e:
                raise UnknownModel(str(e)) from None
        if _HF_REPO.match(name) and not name.startswith((".", "/", "~")):
            return _parse_source(f"hf:{name}", alias=_alias_for(name), fields={})
        looks_like_path = name.startswith((".", "/", "~", "$")) or name.endswith(".gguf")
        if looks_like_path:
            raise UnknownModel(f"no such path: {name}")
        close = difflib.get_close_matches(name, list(self.models), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "see `specmlx models list`"
        raise UnknownModel(f"unknown model '{name}': {hint} (or give a path or hf owner/repo)")

    def pair(self, name: str) -> PairSpec:
        if name not in self.pairs:
            close = difflib.get_close_matches(name, list(self.pairs), n=3, cutoff=0.5)
            names = ", ".join(close or self.pairs)
            hint = f"did you mean {names}?" if close else f"known: {names}"
            raise UnknownModel(f"unknown pair '{name}'; {hint}")
        return self.pairs[name]

    def context_for(self, target: ModelSpec, draft: ModelSpec | None = None) -> int:
        """The context a pair can use: the smaller of the models' own `context` (the one
        trained for), else the [defaults] context."""
        own = [s.context for s in (target, draft) if s is not None and s.context]
        return min(own) if own else self.defaults.context

    def default_pair(self, cpu: bool) -> PairSpec:
        """The pair to use when none is named; `pair_cpu` wins on the CPU backend."""
        name = (self.defaults.pair_cpu if cpu else None) or self.defaults.pair
        if not name:
            raise RegistryError("no [defaults] pair in models.toml; name a pair or add one")
        return self.pair(name)


def _alias_for(ref: str) -> str:
    return Path(ref.split("@")[0].split("#")[-1]).name or ref


def _parse_source(source: str, alias: str, fields: dict) -> ModelSpec:
    """Split `kind:ref[@rev]` and check its shape; ValueError says what is wrong."""
    kind, sep, ref = source.partition(":")
    if not sep or kind not in KINDS or not ref:
        raise ValueError(f"source must start with one of {', '.join(k + ':' for k in KINDS)}")
    revision = None
    if kind == "hf":
        if not _HF_REPO.match(ref):
            raise ValueError(f"hf source must be hf:owner/repo[@revision], got '{source}'")
        ref, _, revision = ref.partition("@")
    elif kind == "wheel" and not WHEEL_RE.match(ref):
        raise ValueError(f"wheel source must be wheel:DIST==VER#path/in/wheel, got '{source}'")
    return ModelSpec(alias=alias, kind=kind, ref=ref, revision=revision or None, **fields)


def _header_parts(line: str) -> list[str] | None:
    m = re.match(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$", line)
    if not m:
        return None
    return [p.strip("\"'") for p in re.findall(r'"[^"]*"|\'[^\']*\'|[^.\s]+', m.group(1))]


def _line_of(text: str, table: tuple[str, ...], key: str | None = None) -> int | None:
    """1-based line of `key` inside `[table]` (or of the header itself), by scanning text."""
    lines = text.splitlines()
    key_re = re.compile(r"^\s*(" + re.escape(key or "") + r'|"' + re.escape(key or "") + r'")\s*=')
    start = 0
    if table:
        heads = [i for i, line in enumerate(lines) if _header_parts(line) == list(table)]
        if not heads:  # an inline table: point at its key in the parent table
            return _line_of(text, table[:-1], table[-1]) if len(table) > 1 else None
        start = heads[0] + 1
        if key is None:
            return start
    for j in range(start, len(lines)):
        parts = _header_parts(lines[j])
        if parts is not None:
            if not table and key and parts[0] == key:
                return j + 1
            if table:
                break
        elif key and key_re.match(lines[j]):
            return j + 1
    return start or None


def _show(table: tuple[str, ...]) -> str:
    return ".".join(p if re.fullmatch(r"[\w-]+", p) else f'"{p}"' for p in table)


def _fail(where: tuple[Path, str], table: tuple[str, ...], key: str | None, msg: str):
    path, text = where
    line = _line_of(text, table, key)
    return RegistryError(f"{path}:{line}: {msg}" if line else f"{path}: {msg}")


_TYPE_NAMES = {
    "int_type": "int",
    "string_type": "str",
    "bool_type": "bool",
    "model_type": "a table",
    "dict_type": "a table",
}


def _split_loc(loc: tuple) -> tuple[tuple[str, ...], str]:
    """A pydantic error loc as (table, key): ('models', 'a', 'quantize', 'gs') is key 'gs' of
    [models.a.quantize]; what follows the key (a union member's name, 'int') is dropped."""
    loc = tuple(str(p) for p in loc)
    depth = min({"models": 2, "pairs": 2, "defaults": 1}.get(loc[0], 0), len(loc) - 1)
    table, rest = loc[:depth], loc[depth:]
    if depth == 2 and table[0] == "models" and rest[0] == "quantize" and len(rest) > 1:
        table, rest = (*table, "quantize"), rest[1:]
    return table, rest[0]


def _schema_of(table: tuple[str, ...]) -> type[_Table]:
    if len(table) == 3:
        return _QuantizeTable
    return {"models": _ModelTable, "pairs": _PairTable, "defaults": _DefaultsTable}.get(
        table[0] if table else "", _FileTable
    )


def _schema_error(e: ValidationError, where: tuple[Path, str]) -> RegistryError:
    """The first of pydantic's errors in file order, as one line that names file:line."""
    path, text = where
    errors = [(*_split_loc(err["loc"]), err) for err in e.errors(include_url=False)]

    def line(item: tuple) -> float:
        table, key, err = item
        return _line_of(text, table, None if err["type"] == "missing" else key) or float("inf")

    table, key, err = min(errors, key=line)
    shown = f" in [{_show(table)}]" if table else ""
    kind, ctx, got = err["type"], err.get("ctx") or {}, err["input"]
    if kind == "missing":
        return _fail(where, table, None, f"[{_show(table)}] has no '{key}'")
    if kind == "extra_forbidden":
        expected = ", ".join(_schema_of(table).model_fields)
        msg = f"unknown key '{key}'{shown} (expected one of: {expected})"
    elif kind in _TYPE_NAMES:  # a union (k: int | str) fails once per member: name them all
        same = [x["type"] for t, k, x in errors if (t, k) == (table, key)]
        wanted = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in same if t in _TYPE_NAMES))
        msg = f"'{key}'{shown} must be {wanted}, got {type(got).__name__}"
    elif kind == "literal_error":
        msg = f"{key}{shown} must be one of {ctx['expected']}, got {got!r}"
    elif kind == "greater_than":
        msg = f"{key}{shown} must be > {ctx['gt']}"
    elif kind == "value_error":
        msg = f"{key}{shown} {ctx['error']}"
    else:
        msg = f"{key}{shown}: {err['msg']}"
    return _fail(where, table, key, msg)


def parse_file(path: Path) -> tuple[dict, dict, dict]:
    """Parse one models.toml into (models, pairs, defaults) with file:line errors."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise RegistryError(f"cannot read model registry {path}: {e.strerror}") from e
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        msg = str(e).split(" (at line")[0]
        loc = f"{path}:{m.group(1)}:{m.group(2)}" if m else str(path)
        raise RegistryError(f"{loc}: TOML syntax error: {msg}") from e
    where = (path, text)
    try:
        parsed = _FileTable.model_validate(data)
    except ValidationError as e:
        raise _schema_error(e, where) from None
    models: dict[str, ModelSpec] = {}
    for alias, raw in parsed.models.items():
        table = ("models", alias)
        # only the keys given: ModelSpec's own defaults fill in the rest
        fields = raw.model_dump(exclude_unset=True, exclude={"source", "quantize"})
        if raw.quantize is not None:
            fields["quantize"] = Quantize(raw.quantize.bits, raw.quantize.group_size)
        try:
            models[alias] = spec = _parse_source(raw.source, alias, fields)
        except ValueError as e:
            raise _fail(where, table, "source", f"{e} in [{_show(table)}]") from None
        gguf = spec.kind in ("gguf", "wheel")
        if spec.keep_quantized and not gguf:
            msg = f"keep_quantized in [{_show(table)}] is for gguf:/wheel: sources only"
            raise _fail(where, table, "keep_quantized", msg)
        if spec.quantize and spec.keep_quantized:
            msg = (
                f"[{_show(table)}] sets both quantize (requantize at load) and keep_quantized "
                "(keep the GGUF's own blocks): pick one"
            )
            raise _fail(where, table, "quantize", msg)
    pairs = {
        name: PairSpec(
            name=name, target=raw.target, draft=raw.draft, k=K.of(raw.k), tree=TreeSize.of(raw.tree)
        )
        for name, raw in parsed.pairs.items()
    }
    return models, pairs, parsed.defaults.model_dump(exclude_unset=True)


def registry_files(extra_paths: list[Path | str] | None = None) -> list[Path]:
    """The shipped file, then ~/.config/specmlx/models.toml, $SPECMLX_MODELS and extras."""
    files = [Path(str(resources.files("specmlx.models") / "models.toml"))]
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or "~/.config").expanduser()
    user = config_home / "specmlx" / "models.toml"
    if user.is_file():
        files.append(user)
    if env := os.environ.get("SPECMLX_MODELS"):
        files.append(expand_path(env))
    files.extend(Path(p) for p in extra_paths or [])
    return files


def _check_head_name(reg: Registry, pair: PairSpec, kind: str, where: str) -> None:
    """Refuse a pair whose head is a plain name that no alias has, as a pair naming an
    unknown draft model is refused: a mistyped alias shows now, not when the pair runs.

    reg: the merged registry; pair: the pair; kind, where: its draft as head_of splits it.
    A path, a `kind:` source or a hub repo is left to be checked when the head loads."""
    if kind == MTP or where in reg.models or re.search(r"[/:~$]|^\.", where):
        return
    if expand_path(where).exists():  # a directory named relative to here
        return
    close = difflib.get_close_matches(where, list(reg.models), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    files = ", ".join(str(f) for f in reg.files)
    raise RegistryError(
        f"pair '{pair.name}' names unknown {kind} head '{where}' (in {files}){hint}"
    )


def load_registry(extra_paths: list[Path | str] | None = None) -> Registry:
    """Merge all registry files (later wins per alias, pair and default) and cross-check."""
    reg = Registry()
    for path in registry_files(extra_paths):
        models, pairs, defaults = parse_file(path)
        reg.models.update(models)
        reg.pairs.update(pairs)
        for key, value in defaults.items():
            setattr(reg.defaults, key, value)
        reg.files.append(path)
    for pair in reg.pairs.values():
        for role in ("target", "draft"):
            alias = getattr(pair, role)
            if role == "draft" and (head := head_of(alias)):
                _check_head_name(reg, pair, *head)
                continue
            if role == "draft" and (alias in DRAFT_WORDS or is_self(alias)):
                continue  # (self-drafting: checked against the target's depth at load)
            if alias not in reg.models:
                files = ", ".join(str(f) for f in reg.files)
                raise RegistryError(
                    f"pair '{pair.name}' names unknown {role} model '{alias}' (in {files})"
                )
    for key in ("pair", "pair_cpu"):
        name = getattr(reg.defaults, key)
        if name is not None and name not in reg.pairs:
            raise RegistryError(f"[defaults] {key} = '{name}' is not a known pair")
    return reg
