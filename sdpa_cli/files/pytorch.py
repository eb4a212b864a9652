"""PyTorch files, what ``torch.save`` writes: recognised by their content, read only
through ``torch.load(weights_only=True)``, never a plain unpickle.

Two formats: a zip archive holding ``<name>/data.pkl`` (torch ≥ 1.6), or the legacy pickle stream, which opens with a pickled
magic number. A file holds a tensor, or a dict (or list) of them, nested as a
checkpoint nests them: members are named by their path, ``model.layers.0.q`` (dict
keys joined by dots, list items by their index), and ``file.pt:name`` picks one, as
for ``.npz``. Entries that are not tensors (an epoch number, a config string) are left
out.

torch is an optional extra (``pip install torch``), imported only when a
PyTorch file is read. Without it, or when ``weights_only`` refuses the file (it pickles
objects other than tensors), the error is one line naming the file. bfloat16 and
float8 tensors become ``ml_dtypes`` arrays, as safetensors' do.
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import ml_dtypes
from numpy.typing import NDArray

from sdpa_cli.errors import InputError
from sdpa_cli.files import limits
from sdpa_cli.files.checks import check_dtype, check_shape, pick_member, reading
from sdpa_cli.files.opening import Input, opened
from sdpa_cli.text import one_line, printable

TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
"""Extensions PyTorch files go by (the format is still sniffed from the content)."""

LEGACY_MAGIC = b"\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19"
"""What a legacy ``torch.save`` stream pickles first: its magic number
0x1950a86a20f9469cfc6c as a 10-byte long (LONG1), after the PROTO opcode and, from
protocol 4 on, a FRAME."""

HEAD_BYTES = 32
"""Bytes :func:`is_legacy_torch` needs from the start of a file."""

INSTALL = "a PyTorch file; install torch to read it (pip install torch) or save it with numpy.save"

_BY_VIEW = {
    "bfloat16": ("int16", ml_dtypes.bfloat16),
    "float8_e4m3fn": ("uint8", ml_dtypes.float8_e4m3fn),
    "float8_e5m2": ("uint8", ml_dtypes.float8_e5m2),
}
"""torch dtypes numpy lacks: read through an integer view of the same width."""

_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")
"""Lines of torch's weights_only error that say nothing about this file."""


def is_pickle(head: bytes) -> bool:
    """A pickle stream of protocol 2 or later starts with PROTO (0x80) and its number."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def is_legacy_torch(head: bytes) -> bool:
    """A legacy ``torch.save`` stream: PROTO, an optional FRAME, then the magic number."""
    if not is_pickle(head):
        return False
    at = 2 + (9 if head[2:3] == b"\x95" else 0)  # FRAME: the opcode and an 8-byte length
    return head[at : at + len(LEGACY_MAGIC)] == LEGACY_MAGIC


def is_torch_archive(fh: IO[bytes]) -> bool:
    """A zip archive holding ``<name>/data.pkl``, as ``torch.save`` writes it."""
    try:
        fh.seek(0)
        with zipfile.ZipFile(fh) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return False
    finally:
        fh.seek(0)
    return any(n.endswith("/data.pkl") and n.count("/") == 1 for n in names)


def load_torch(path: Path | Input, member: str | None, label: str) -> NDArray[Any]:
    """One tensor of a PyTorch file as a numpy array, read into memory; ``label``
    already ends in ``:member`` when one was given.

    Raises:
        InputError: naming the file (or member): torch missing, a file weights_only
            refuses, no tensor, a missing member, a tensor numpy cannot hold.
    """
    tensors = dict(_tensors(_load(path, label), _stem(path, label)))
    name, member_label = pick_member(label, list(tensors), member, "tensor")
    return _to_numpy(tensors[name], member_label)


def torch_arrays(path: Path | Input, label: str) -> list[tuple[str, NDArray[Any] | InputError]]:
    """Every tensor of a PyTorch file, by name, in the file's order: its array, or
    why it cannot be read (a sparse tensor, complex numbers), so one member does not
    hide the others.

    Raises:
        InputError: the file as a whole cannot be read, or holds no tensor.
    """
    found: list[tuple[str, NDArray[Any] | InputError]] = []
    for name, tensor in _tensors(_load(path, label), _stem(path, label)):
        try:
            found.append((name, _to_numpy(tensor, f"{label}:{printable(name)}")))
        except InputError as exc:
            found.append((name, exc))
    if not found:
        raise InputError(label, "holds no tensors")
    return found


def _stem(path: Path | Input, label: str) -> str:
    """What a lone tensor is named after: the file's stem (``q.pt`` → ``q``)."""
    return Path(label if isinstance(path, Input) else path).stem


def _load(path: Path | Input, label: str) -> Any:
    """``torch.load(file, weights_only=True, map_location="cpu")`` from the opened
    file (read into memory, never memory-mapped: a file truncated under the run must
    be an error, not a SIGBUS), after its size is checked against the memory."""
    try:
        # imported here: torch is an optional extra, and slow to import
        import torch
    except ImportError:
        raise InputError(label, INSTALL) from None
    try:
        with opened(path, label) as inp:
            _check_size(inp, label, is_torch_archive(inp.fh))
            with warnings.catch_warnings():
                # torch warns of pickle protocols and deprecations on stderr: not ours to print
                warnings.simplefilter("ignore")
                return torch.load(inp.fh, weights_only=True, map_location="cpu")
    except InputError:
        raise
    except pickle.UnpicklingError as exc:
        raise InputError(label, _refused(exc)) from None
    except MemoryError:
        raise InputError(label, "does not fit in memory") from None
    except Exception as exc:  # a corrupt archive or stream: RuntimeError, EOFError, ...
        raise InputError(
            label, f"cannot be read by torch.load ({type(exc).__name__}: {_reason(exc)})"
        ) from None


def _check_size(inp: Input, label: str, archive: bool) -> None:
    """Refuse what cannot fit in memory before torch allocates it: the file is read
    whole, and an archive's compressed members (torch writes none) are inflated."""
    available = limits.available_memory()
    if available is None:
        return
    need = inp.size
    with reading(label):
        if archive:
            with zipfile.ZipFile(inp.fh) as zf:
                need += sum(
                    i.file_size for i in zf.infolist() if i.compress_type != zipfile.ZIP_STORED
                )
            inp.fh.seek(0)
    if need > available:
        gib = 2.0**30
        raise InputError(
            label,
            f"needs {need / gib:.1f} GiB of memory to be read, but {available / gib:.1f} GiB "
            "is available",
        )


def _refused(exc: Exception) -> str:
    """weights_only's refusal in one line: the reason torch gives, less its preamble."""
    reason = _reason(exc)
    if "Unsupported operand" in reason:  # an opcode weights_only has no reader for
        return (
            f"torch.load(weights_only=True) cannot read its pickle ({reason}); re-save it "
            "with torch.save's default format"
        )
    return (
        f"torch.load(weights_only=True) refuses it ({reason}): it pickles objects other "
        "than tensors, and sdpa never unpickles them; save the tensors alone (a tensor, "
        "or a dict of tensors)"
    )


def _reason(exc: Exception) -> str:
    lines = [line.strip() for line in str(exc).splitlines()]
    kept = [line for line in lines if line and not line.startswith(_BOILERPLATE)]
    text = one_line(" ".join(kept) or type(exc).__name__)
    return text if len(text) <= 160 else text[:157] + "..."


def _tensors(obj: Any, stem: str, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The tensors of a loaded object, named by their path (``a.b.0``), a lone tensor
    after the file (``q.pt`` → ``q``, as ``.npy``); anything else is skipped."""
    # imported here: only a PyTorch file's reading needs it (see _load)
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix or stem, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, stem, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, stem, f"{prefix}.{i}" if prefix else str(i))


def _to_numpy(tensor: Any, label: str) -> NDArray[Any]:
    """A dense CPU tensor as a numpy array sharing its memory (no copy)."""
    import torch  # imported here: see _load

    t: Any = tensor.detach()
    if t.layout != torch.strided or t.is_quantized:
        kind = "quantized" if t.is_quantized else str(t.layout).removeprefix("torch.")
        raise InputError(label, f"is a {kind} tensor; sdpa reads dense ones (tensor.to_dense())")
    name = str(t.dtype).removeprefix("torch.")
    check_shape(tuple(int(n) for n in t.shape), label)
    if name in _BY_VIEW:
        width, dtype = _BY_VIEW[name]
        return t.view(getattr(torch, width)).numpy().view(dtype)  # type: ignore[no-any-return]
    try:
        arr: NDArray[Any] = t.numpy()
    except TypeError:  # a dtype numpy has no counterpart of (complex32, float8 variants...)
        raise InputError(
            label, f"has dtype {name}, which sdpa cannot read; convert it (tensor.float())"
        ) from None
    check_dtype(arr.dtype, label)
    return arr
