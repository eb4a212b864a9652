"""What a capture writes: a ``.safetensors`` file per call, streamed tensor by tensor
from the device, and the manifest ``sdpa check --manifest`` runs with its sidecar.

The safetensors format: ``N`` (8 bytes, little-endian), ``N`` bytes of JSON (padded with
spaces to a multiple of 8), then the tensors' bytes, each tensor's
``{"dtype", "shape", "data_offsets"}`` in the JSON. bfloat16 stays bfloat16 (``BF16``),
which sdpa reads natively (``files/safetensors.py``), so ``check`` sees the format the
kernel ran in without a ``dtype`` option.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from sdpa_cli.errors import SpecError
from sdpa_cli.files.tokens import TOKENS_FILE
from sdpa_cli.files.writers import write_all_atomic, write_atomic
from sdpa_cli.text import shown

SAFETENSORS_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
"""torch dtype name → safetensors code, for the dtypes sdpa reads."""
TENSOR_KEYS = {
    "q": "q",
    "k": "k",
    "v": "v",
    "mask": "mask",
    "output": "expect-output",
    "weights": "expect-weights",
}
"""A call file's tensor → the manifest key that names it."""
GRADIENT_KEYS = {"dout": "dout", "dq": "expect-dq", "dk": "expect-dk", "dv": "expect-dv"}
"""A call's gradient (recorded by ``capture(backward=True)``) → the manifest key that
names it, for ``sdpa check`` to judge the backward kernel; a case file takes none."""
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def parse_size(text: str, where: str = "--max-bytes") -> int:
    """``1000``, ``500MB``, ``2GiB``, ``1.5G``: a byte count. kB, MB, GB, TB are powers of
    1000; KiB, MiB, GiB, TiB and the bare K, M, G, T powers of 1024.

    Raises:
        SpecError: naming ``where``.
    """
    found = _SIZE.fullmatch(text)
    unit = found[2].lower() if found else None
    if found is None or unit not in _UNITS:
        raise SpecError(where, f"expected a size such as 500MB or 2GiB, got {shown(text)}")
    size = int(float(found[1]) * _UNITS[unit])
    if size <= 0:
        raise SpecError(where, f"must be positive, got {shown(text)}")
    return size


def file_stem(number: int, name: str) -> str:
    """``00012-model.layers.3.self_attn``: the call's number, then its name in characters
    safe in any file system and in ``FILE.safetensors:NAME`` (no colon)."""
    return f"{number:05d}-{_UNSAFE.sub('_', name)[:120]}"


def unwritable(tensors: Mapping[str, Any]) -> str | None:
    """Why a call's tensors cannot be written for sdpa (a dtype it does not read, no
    data), or None."""
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in SAFETENSORS_CODES:
            return f"its {name} is {dtype}, which sdpa does not read"
        if tensor.device.type == "meta":
            return f"its {name} is on the meta device (no data)"
    return None


def tensors_size(tensors: Mapping[str, Any]) -> int:
    """The bytes of the tensors' data (the file adds its header)."""
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors.values())


def safetensors_header(tensors: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """The JSON header of a safetensors file of ``tensors`` (padded to 8 bytes)."""
    return _header(_entries(tensors), metadata)


def _entries(tensors: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each tensor's header entry, at its offset after the ones before it."""
    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, tensor in tensors.items():
        size = int(tensor.numel()) * int(tensor.element_size())
        entries[name] = {
            "dtype": SAFETENSORS_CODES[str(tensor.dtype).removeprefix("torch.")],
            "shape": [int(n) for n in tensor.shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    return entries


def _header(entries: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata), **entries}
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # the format aligns the data buffer to 8 bytes


def _shifted(entries: Mapping[str, dict[str, Any]], by: int) -> dict[str, dict[str, Any]]:
    return {
        name: {**e, "data_offsets": [e["data_offsets"][0] + by, e["data_offsets"][1] + by]}
        for name, e in entries.items()
    }


def grown_size(
    tensors: Mapping[str, Any], metadata: Mapping[str, str], more: Mapping[str, Any]
) -> int:
    """The size of a file of ``tensors`` once tensors shaped as ``more`` (a gradient
    name → the tensor it is shaped as) join it (:func:`add_safetensors`)."""
    entries = _entries(tensors)
    data = tensors_size(tensors)
    header = _header({**entries, **_shifted(_entries(more), data)}, metadata)
    return 8 + len(header) + data + tensors_size(more)


def write_safetensors(
    path: Path, tensors: Mapping[str, Any], metadata: Mapping[str, str], torch: Any
) -> int:
    """Write torch ``tensors`` (on any device) to ``path``, atomically; its size in bytes.

    One tensor at a time is copied to the host and written, so the host holds one
    tensor of the call, never the capture.
    """
    text = safetensors_header(tensors, metadata)

    def write(fh: BinaryIO) -> None:
        fh.write(len(text).to_bytes(8, "little"))
        fh.write(text)
        for tensor in tensors.values():
            host = tensor.detach().to("cpu").contiguous().reshape(-1)
            fh.write(host.view(torch.uint8).numpy().data)

    write_atomic(path, write)
    return 8 + len(text) + tensors_size(tensors)


def add_safetensors(path: Path, tensors: Mapping[str, Any], torch: Any) -> int:
    """Add torch ``tensors`` (on the host) to the safetensors file ``path`` after the
    ones it holds, atomically; its new size in bytes. The file's data is copied, not
    read whole: the host holds one of the new tensors at a time."""
    import shutil  # imported here: only a backward capture grows its files

    with open(path, "rb") as old:
        n = int.from_bytes(old.read(8), "little")
        header = json.loads(old.read(n))
    metadata = header.pop("__metadata__", {})
    data = max((e["data_offsets"][1] for e in header.values()), default=0)
    text = _header({**header, **_shifted(_entries(tensors), data)}, metadata)

    def write(fh: BinaryIO) -> None:
        fh.write(len(text).to_bytes(8, "little"))
        fh.write(text)
        with open(path, "rb") as old:
            old.seek(8 + n)
            shutil.copyfileobj(old, fh, 1 << 20)
        for tensor in tensors.values():
            host = tensor.detach().to("cpu").contiguous().reshape(-1)
            fh.write(host.view(torch.uint8).numpy().data)

    write_atomic(path, write)
    return 8 + len(text) + data + tensors_size(tensors)


def manifest_case(
    name: str, file: str, tensors: Mapping[str, Any], options: Mapping[str, Any], description: str
) -> dict[str, Any]:
    """The manifest entry of a recorded call: its name, a description, the tensors as
    ``FILE.safetensors:NAME`` relative to the manifest, then the options."""
    entry: dict[str, Any] = {"name": name, "description": description}
    for key in TENSOR_KEYS:
        if key in tensors:
            entry[TENSOR_KEYS[key]] = f"{file}:{key}"
    entry.update(options)
    return entry


def with_gradients(
    case: Mapping[str, Any], file: str, gradients: Mapping[str, Any]
) -> dict[str, Any]:
    """A manifest entry with a call's recorded gradients listed after its tensors
    (``dout``, ``expect-dq``, ``expect-dk``, ``expect-dv``: :data:`GRADIENT_KEYS`);
    none without dO, which the check needs to judge any of them, or without one of
    them (dO alone judges nothing)."""
    listed = {GRADIENT_KEYS[g]: f"{file}:{g}" for g in GRADIENT_KEYS if g in gradients}
    if "dout" not in listed or len(listed) == 1:
        return dict(case)
    tensor_keys = set(TENSOR_KEYS.values())
    entry: dict[str, Any] = {}
    for key, value in case.items():
        if key not in tensor_keys and key not in ("name", "description"):
            entry.update(listed)
            listed = {}
        entry[key] = value
    entry.update(listed)
    return entry


def case_file(entry: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A manifest entry as a case file beside its tensors (``tensors/NAME.yaml``), which
    ``sdpa compute``, ``explain`` and ``grad`` take alone: its path relative to the
    capture's folder, and its contents (the tensors relative to it, the options, the
    description; no expectations)."""
    tensor_file, _, _ = str(entry["q"]).rpartition(":")
    folder, _, file_name = tensor_file.rpartition("/")
    data: dict[str, Any] = {"description": f"{entry['name']}: {entry['description']}"}
    for key, value in entry.items():
        if key in ("name", "description", "dout") or key.startswith("expect-"):
            continue
        if key in TENSOR_KEYS.values():
            data[key] = str(value).removeprefix(f"{folder}/")
        else:
            data[key] = value
    return f"{folder}/{file_name.removesuffix('.safetensors')}.yaml", data


MANIFEST_HEADER = """\
# Written by sdpa capture: every attention call recorded, one case each.
# Check them all:  sdpa check --manifest {manifest}
# {counts}
# Where each call came from (layer, call number, function, device, dtype, layout) is in
# calls.yaml beside this file; calls that cannot be replayed are listed there, not here.
"""


CASE_HEADER = """\
# Written by sdpa capture: one attention call, as a case file that sdpa compute,
# explain and grad take alone (sdpa compute THIS.yaml).
"""


IN_PROGRESS = "capture in progress, or ended without its end (os._exit, a crash): every call up to the last is here"
"""What the documents say of their counts while the calls are appended."""


def _dump(data: Any) -> bytes:
    import yaml  # imported here: only a capture's records need it

    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1 << 16)
    return str(text).encode()


def list_item(entry: Mapping[str, Any]) -> bytes:
    """``entry`` as one item of a YAML list (``- name: ...``), as the documents hold it."""
    return _dump([dict(entry)])


def _started(shown: Path) -> tuple[bytes, bytes]:
    """The in-progress heads of ``manifest.yaml`` and ``calls.yaml``."""
    manifest = MANIFEST_HEADER.format(manifest=shown / "manifest.yaml", counts=IN_PROGRESS)
    calls = b"# Written by sdpa capture: " + IN_PROGRESS.encode() + b"\ncalls:\n"
    return manifest.encode() + b"cases:\n", calls


def record_progress(
    folder: Path, case: Mapping[str, Any] | None, call: Mapping[str, Any], shown: Path
) -> None:
    """One recorded call on disk at once: its case file (when it has a case) and its
    entries appended to ``manifest.yaml`` and ``calls.yaml`` (each started with its
    header on the first), so a program that ends without unwinding leaves every call
    it made checkable. :func:`write_documents` rewrites them whole at the end.
    ``shown``: the folder as given, as the manifest's header names it."""
    manifest, calls = _started(shown)
    if case is not None:
        path, data = case_file(case)
        write_atomic(folder / path, _writes(CASE_HEADER.encode() + _dump(data)))
        _append(folder / "manifest.yaml", manifest, list_item(case))
    _append(folder / "calls.yaml", calls, list_item(call))


def rewrite_progress(folder: Path, cases: list[bytes], calls: list[bytes], shown: Path) -> None:
    """``manifest.yaml`` (when it has cases) and ``calls.yaml`` rewritten whole from
    their entries (:func:`list_item`) while the capture runs: after a backward pass,
    whose gradients joined cases :func:`record_progress` appended. Case files do not
    change (they take no gradient)."""
    manifest, started = _started(shown)
    files = [(folder / "calls.yaml", started + b"".join(calls))]
    if cases:
        files.append((folder / "manifest.yaml", manifest + b"".join(cases)))
    write_all_atomic([(path, _writes(data)) for path, data in files])


def _append(path: Path, start: bytes, item: bytes) -> None:
    """``item`` (a YAML list's entry) at the end of ``path``, after ``start`` when the
    file is new: one write each, in the kernel's hands once it returns."""
    with open(path, "ab") as fh:
        fh.write((start if fh.tell() == 0 else b"") + item)


def write_documents(
    folder: Path,
    cases: list[dict[str, Any]],
    calls: list[dict[str, Any]],
    counts: str,
    shown: Path | None = None,
) -> Path | None:
    """``manifest.yaml`` and a case file per case (when a case was recorded) and
    ``calls.yaml``, atomically, all or none; the manifest's path, or None when none
    was written. ``shown``: the folder as given, as the manifest's header names it."""
    dump = _dump
    manifest = folder / "manifest.yaml"
    files: list[tuple[Path, bytes]] = [
        (
            folder / "calls.yaml",
            b"# Written by sdpa capture: " + counts.encode() + b"\n" + dump({"calls": calls}),
        )
    ]
    if cases:
        named = (shown if shown is not None else folder) / "manifest.yaml"
        header = MANIFEST_HEADER.format(manifest=named, counts=counts)
        files.insert(0, (manifest, header.encode() + dump({"cases": cases})))
        for entry in cases:
            path, data = case_file(entry)
            files.append((folder / path, CASE_HEADER.encode() + dump(data)))
    write_all_atomic([(path, _writes(data)) for path, data in files])
    return manifest if cases else None


def _writes(data: bytes) -> Any:
    return lambda fh: fh.write(data)


def token_labels(tokens: Sequence[str] | None) -> list[str] | None:
    """``capture(tokens=...)`` checked: strings, one label a position.

    Raises:
        SpecError: a label that is not a string.
    """
    if tokens is not None and not all(isinstance(t, str) for t in tokens):
        raise SpecError("tokens", "must be strings, one label a position")
    return None if tokens is None else list(tokens)


def write_tokens(folder: Path, tokens: list[str] | None) -> None:
    """A capture's labels of its positions, as ``tokens.json`` beside its manifest (the
    pages' axes: ``sdpa report model --html``); nothing without them."""
    if tokens is not None:
        text = json.dumps(tokens, ensure_ascii=False).encode()
        write_atomic(folder / TOKENS_FILE, _writes(text))
