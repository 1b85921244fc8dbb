"""A ``torch.save``d state_dict (the zip format, torch >= 1.6) read without torch and without
running the pickle's code: only the few globals a state_dict of tensors names are let through
(an OrderedDict, torch's tensor and parameter rebuilders, its storage kinds), each replaced by
a stand-in here; any other is refused before it is imported. Storages are read from the zip's
data/ entries with numpy and bounds-checked before a strided view is taken. Medusa's published
heads (``medusa_lm_head.pt``) are such files.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import mlx.core as mx
import numpy as np

from ...errors import BadInput


def one_line(e: BaseException) -> str:
    """An exception as a short clause on one line (for a BadInput naming a file)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


@dataclass(frozen=True)
class _StorageKind:
    """Stands in for a torch storage class (``torch.FloatStorage``...) in the pickle: only its
    element type is needed. Not callable, so a pickle cannot construct anything with it."""

    name: str
    dtype: str  # numpy's name; bfloat16 travels as its bits in uint16


_KINDS = {
    name: _StorageKind(name, dtype)
    for name, dtype in {
        "FloatStorage": "float32",
        "HalfStorage": "float16",
        "BFloat16Storage": "bfloat16",
        "DoubleStorage": "float64",
        "LongStorage": "int64",
        "IntStorage": "int32",
        "ShortStorage": "int16",
        "CharStorage": "int8",
        "ByteStorage": "uint8",
        "BoolStorage": "bool",
        "UntypedStorage": "uint8",  # torch.load reads an untyped storage as bytes too
    }.items()
}


@dataclass(frozen=True)
class _Storage:
    """One storage file's elements, flat (numel,), as numpy (bfloat16 as uint16 bits)."""

    data: np.ndarray
    bfloat16: bool


def _rebuild_tensor(
    storage: _Storage,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool = False,
    hooks: object = None,
    metadata: object = None,
) -> mx.array:
    """``torch._utils._rebuild_tensor_v2``'s stand-in: the strided view of a storage as an
    MLX array, bounds checked first (a pickle's numbers are not trusted with memory).

    storage: the elements; offset: the first element's index; size, stride: the view's
    shape and strides in elements; requires_grad, hooks, metadata: torch's, ignored."""
    if not isinstance(storage, _Storage):
        raise ValueError("a tensor without a storage")
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or min(size + stride + (offset,), default=0) < 0:
        raise ValueError(f"a tensor with size {size}, stride {stride}, offset {offset}")
    n = storage.data.size
    last = (
        offset + sum((s - 1) * st for s, st in zip(size, stride, strict=True)) if all(size) else -1
    )
    if last >= n or offset > n:
        raise ValueError(f"a tensor of size {size} past its storage's {n} elements")
    item = storage.data.itemsize
    flat = storage.data[offset:] if all(size) else storage.data[:0]
    view = np.lib.stride_tricks.as_strided(
        flat, shape=size, strides=tuple(st * item for st in stride), writeable=False
    )
    out = mx.array(np.ascontiguousarray(view))  # copies: the view must not outlive the bytes
    if storage.bfloat16:
        return out.view(mx.bfloat16)
    return out.astype(mx.float32) if out.dtype == mx.float64 else out


def _rebuild_parameter(
    data: mx.array, requires_grad: bool = False, hooks: object = None
) -> mx.array:
    """``torch._utils._rebuild_parameter``'s stand-in (a saved nn.Parameter): the data.

    data: the tensor; requires_grad, hooks: torch's, ignored."""
    return data


# every global a weights-only state_dict pickle names, and what it becomes here
_ALLOWED: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): kind for name, kind in _KINDS.items()},
    ("torch.storage", "UntypedStorage"): _KINDS["UntypedStorage"],
}


class _StateDictUnpickler(pickle.Unpickler):
    """Unpickles a torch checkpoint's data.pkl with nothing run but _ALLOWED: any other
    global is refused before it is imported; storages come from the zip's data/ entries.

    file: the pickle stream; zf: the open zip; prefix: the archive's folder ("archive/");
    big: whether the storages were written big-endian (the zip's byteorder entry)."""

    def __init__(self, file: IO[bytes], zf: zipfile.ZipFile, prefix: str, big: bool):
        super().__init__(file)
        self.zf, self.prefix, self.big = zf, prefix, big
        self.storages: dict[str, _Storage] = {}  # by key: tensors that share one share it

    def find_class(self, module: str, name: str) -> object:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: object) -> _Storage:
        # ('storage', kind, key, location, numel): torch's id for a storage it wrote to data/key
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise ValueError(f"an unknown persistent id {pid!r:.60}")
        _, kind, key, _, numel = pid
        if not isinstance(kind, _StorageKind) or not isinstance(key, str):
            raise ValueError(f"a storage id {pid!r:.60}")
        if key not in self.storages:
            bf16 = kind.dtype == "bfloat16"
            dtype = np.dtype("uint16" if bf16 else kind.dtype).newbyteorder(
                ">" if self.big else "<"
            )
            raw = self.zf.read(f"{self.prefix}data/{key}")
            need = int(numel) * dtype.itemsize
            if len(raw) < need:
                raise ValueError(f"storage {key} has {len(raw)} bytes, not {need}")
            data = np.frombuffer(raw, dtype=dtype, count=int(numel))
            self.storages[key] = _Storage(data.astype(dtype.newbyteorder("=")), bf16)
        return self.storages[key]


class _Refused(Exception):
    """A pickle asked for a global outside _ALLOWED (the name is the message)."""


def read_torch_zip(file: str | Path) -> dict[str, mx.array]:
    """A ``torch.save``d state_dict (the zip format, torch >= 1.6) as MLX arrays, read with
    the standard library and numpy alone and no code from the file run.

    file: the checkpoint. BadInput, naming the file, where it is not such a zip, its pickle
    asks for anything a state_dict does not need, or it is not a flat dict of tensors."""
    file = Path(file)
    try:
        zf = zipfile.ZipFile(file)
    except (OSError, zipfile.BadZipFile) as e:
        raise BadInput(f"{file}: not a torch zip checkpoint ({one_line(e)})") from None
    with zf:
        pkls = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise BadInput(f"{file}: not a torch zip checkpoint (no single */data.pkl)")
        prefix = pkls[0][: -len("data.pkl")]
        try:
            order = zf.read(prefix + "byteorder").decode().strip()
        except KeyError:
            order = "little"  # torch wrote no byteorder before 1.10: little-endian then
        try:
            with zf.open(pkls[0]) as f:
                state = _StateDictUnpickler(f, zf, prefix, order == "big").load()
        except _Refused as e:
            raise BadInput(
                f"{file}: its pickle asks for {e}, which a state_dict of tensors never needs "
                "(refused, nothing run)"
            ) from None
        except Exception as e:  # a damaged pickle or zip: any of the unpickler's errors
            raise BadInput(f"{file}: unreadable torch checkpoint ({one_line(e)})") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, mx.array) for k, v in state.items()
    ):
        raise BadInput(f"{file}: not a state_dict (a dict of names to tensors)")
    return dict(state)
