"""llama.cpp's tokenizer test vectors (vocab-only GGUF files plus .inp/.out pairs), fetched once.

They ship inside the llama-cpp-python source distribution on PyPI (vendor/llama.cpp/models/), so
one `pip download` (a 50.7 MB sdist, ~5 s) gets all of them; only the `models/ggml-vocab-*` files
(54 MB) are kept, in ``$SPECMLX_TEST_CACHE/llama-vocab/<version>`` (default
``~/.cache/specmlx-tests/llama-vocab/<version>``), and later runs need no network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# Pinned so the vectors (and the tokens they expect) never change under us.
LLAMA_CPP_PYTHON = "0.3.16"
_MEMBER = "/vendor/llama.cpp/models/ggml-vocab-"
# llama.cpp's separator between inputs in a .inp file (test-tokenizer-0.cpp).
_SEPARATOR = "\n__ggml_vocab_test__\n"


class VocabUnavailable(RuntimeError):
    """The vocab files are neither cached nor downloadable (offline, PyPI down, ...)."""


def cache_dir() -> Path:
    """Where the ggml-vocab-* files live once fetched."""
    root = os.environ.get("SPECMLX_TEST_CACHE") or Path.home() / ".cache" / "specmlx-tests"
    return Path(root) / "llama-vocab" / LLAMA_CPP_PYTHON


def vocab_dir() -> Path:
    """The directory holding llama.cpp's ggml-vocab-* files, downloading them on first use.

    Raises VocabUnavailable (with pip's error) when they are not cached and the download fails.
    """
    target = cache_dir()
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        sdist = _download_sdist(Path(tmp))
        staged = Path(tmp) / "models"
        _extract_vocab_files(sdist, staged)
        (staged / ".complete").write_text(f"llama-cpp-python=={LLAMA_CPP_PYTHON}\n")
        # Stage then rename, so an interrupted run never leaves a half-filled cache behind.
        try:
            staged.rename(target)
        except OSError:
            if not (target / ".complete").exists():  # not just a concurrent run that won
                shutil.rmtree(target, ignore_errors=True)
                staged.rename(target)
    return target


def vocab_file(name: str) -> Path:
    """Path of ``ggml-vocab-{name}.gguf`` (e.g. "qwen2", "llama-bpe"), downloading if needed."""
    path = vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        raise VocabUnavailable(f"llama-cpp-python {LLAMA_CPP_PYTHON} has no {path.name}")
    return path


def qwen2_vocab() -> Path:
    """The real Qwen2 vocab-only GGUF, downloading it if needed; VocabUnavailable if not.

    151,936 tokens, byte-level BPE, pre-tokenizer "qwen2": the 151,643 ordinary tokens and merges
    of Qwen1.5/Qwen2/Qwen2.5(-Coder), then only <|endoftext|> (151643, also BOS/EOS/pad),
    <|im_start|>, <|im_end|>, and "[PAD151646]".. "[PAD151935]" fillers: Qwen2.5's FIM and tool
    tokens are absent, and it holds no chat template.
    """
    return vocab_file("qwen2")


def vocab_file_or_skip(name: str) -> Path:
    """vocab_file(name) for a test, which skips (naming why) when the files are unavailable."""
    import pytest

    try:
        return vocab_file(name)
    except VocabUnavailable as e:
        pytest.skip(f"llama.cpp vocab files unavailable: {e}")


def read_vectors(gguf: Path) -> list[tuple[str, list[int]]]:
    """(input text, expected ids) pairs from ``<gguf>.inp`` / ``<gguf>.out``, as llama.cpp reads them.

    Inputs are separated by "\\n__ggml_vocab_test__\\n" (the file ends with one); each .out line
    holds one input's ids, space-separated (an empty line for the empty input).
    """
    raw = Path(f"{gguf}.inp").read_bytes().decode("utf-8")
    inputs = raw.split(_SEPARATOR)
    if inputs and inputs[-1] == "":  # the trailing separator ends the file, not an input
        inputs.pop()
    outputs = Path(f"{gguf}.out").read_text(encoding="utf-8").split("\n")
    if outputs and outputs[-1] == "":
        outputs.pop()
    if len(inputs) != len(outputs):
        raise ValueError(f"{gguf}: {len(inputs)} inputs but {len(outputs)} outputs")
    return [(s, [int(t) for t in o.split()]) for s, o in zip(inputs, outputs, strict=True)]


def _download_sdist(dest: Path) -> Path:
    # Only llama-cpp-python itself as an sdist: ":all:" would also build pip's metadata step's
    # build dependencies from source (4 minutes instead of 4 seconds).
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(dest)]
    cmd += [f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VocabUnavailable(f"pip download llama-cpp-python failed: {e}") from None
    found = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if done.returncode != 0 or not found:
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
        raise VocabUnavailable(f"pip download llama-cpp-python failed: {' | '.join(why)}")
    return found[0]


def _extract_vocab_files(sdist: Path, dest: Path) -> None:
    dest.mkdir()
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            if not member.isfile() or _MEMBER not in member.name:
                continue
            name = Path(member.name).name  # flattened: no path from the archive is trusted
            src = tar.extractfile(member)
            assert src is not None
            with src, open(dest / name, "wb") as out:
                shutil.copyfileobj(src, out)
    if not any(dest.glob("ggml-vocab-*.gguf")):
        raise VocabUnavailable(f"{sdist.name} holds no ggml-vocab-*.gguf files")
