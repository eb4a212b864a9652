"""A capture: the calls caught while it runs, bounded, written as they come.

Calls are numbered in the order they return (1, 2, ...), named by the module they came
from (``model.layers.3.self_attn``; ``model.layers.3.self_attn#2`` the second time that
module attends, during generation say) or, outside any module, ``call-N``. Which calls
are recorded: those whose name ``match`` selects, then every ``every``-th of them, up to
``max_calls``, while their files fit in ``max_bytes`` (the first that does not stops the
capture, with one line on stderr).

With ``backward``, a recorded call whose output requires grad is hooked
(:mod:`~sdpa_cli.capture.backward`): when the program's backward pass reaches it, its
dO and the gradients of its Q, K, V join its file (``dout``, ``dq``, ``dk``, ``dv``),
and its case lists them (``dout``, ``expect-dq``, ``expect-dk``, ``expect-dv``) for
``sdpa check`` to judge the backward kernel; ``max_bytes`` counts them from the
forward call on. Each call's gradients are on disk as they arrive; the manifest and
``calls.yaml`` list them at the end of each backward pass.
"""

from __future__ import annotations

import fnmatch
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from sdpa_cli.capture.backward import Gradients
from sdpa_cli.capture.calls import GRADIENTS, Call, layer_of
from sdpa_cli.capture.hooks import Interceptor
from sdpa_cli.capture.layers import case_description, describe_layer
from sdpa_cli.capture.writer import (
    add_safetensors,
    file_stem,
    grown_size,
    list_item,
    manifest_case,
    parse_size,
    record_progress,
    rewrite_progress,
    safetensors_header,
    tensors_size,
    token_labels,
    unwritable,
    with_gradients,
    write_documents,
    write_safetensors,
    write_tokens,
)
from sdpa_cli.errors import InputError, SpecError
from sdpa_cli.files.tokens import TOKENS_FILE
from sdpa_cli.text import plural, shown, si

INSTALL_TORCH = "pip install torch"
TENSORS = "tensors"
_LOCK = threading.Lock()
_RUNNING: list[Capture] = []


def _with_gradients(n: int) -> str:
    if n == 0:
        return "none with gradients (no backward pass reached them)"
    return f"{n} with {'its' if n == 1 else 'their'} gradients"


def _stderr(line: str) -> None:
    print(f"sdpa capture: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Summary:
    """What a capture did.

    Attributes:
        seen: attention calls made while it ran.
        captured: calls recorded (a file each).
        skipped: of those, calls ``sdpa check`` cannot replay (listed in calls.yaml only).
        bytes: the bytes of the call files.
        folder: where it wrote.
        manifest: the manifest's path, or None when no call could go in one.
        stopped: why it stopped before the end (``max_bytes``), or None.
        gradients: calls whose gradients were recorded, or None when the capture was
            not asked for them (``backward``).
    """

    seen: int
    captured: int
    skipped: int
    bytes: int
    folder: Path
    manifest: Path | None
    stopped: str | None = None
    gradients: int | None = None

    def line(self) -> str:
        """One line for a person: calls, bytes, where the manifest is."""
        if not self.captured:
            return f"no attention call captured ({plural(self.seen, 'call')} seen); nothing written to check"
        text = (
            f"{self.captured} of {plural(self.seen, 'attention call')} captured "
            f"({si(self.bytes, 'B')}) in {self.folder}"
        )
        if self.skipped:
            text += f", {self.skipped} not replayable (see calls.yaml)"
        if self.gradients is not None:
            text += f", {_with_gradients(self.gradients)}"
        if self.stopped:
            text += "; stopped by max_bytes"
        if self.manifest is not None:
            text += f"; check them: sdpa check --manifest {self.manifest}"
        return text


class Capture:
    """Records every attention call made inside ``with``; see :func:`capture`."""

    def __init__(
        self,
        out: str | Path,
        *,
        max_calls: int | None = None,
        match: str | None = None,
        every: int = 1,
        max_bytes: int | str | None = None,
        notify: Callable[[str], None] | None = None,
        replace: bool = False,
        backward: bool = False,
        tokens: Sequence[str] | None = None,
    ) -> None:
        self.tokens = token_labels(tokens)
        if isinstance(max_bytes, str):
            max_bytes = parse_size(max_bytes, "max_bytes")
        for label, value in (("max_calls", max_calls), ("every", every), ("max_bytes", max_bytes)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise SpecError(label, f"must be a positive integer, got {shown(value)}")
        self.shown = Path(out)
        """The folder as given: what messages and the summary name."""
        self.folder = _absolute(self.shown)
        """The folder it meant at the start, whatever directory the program moves to."""
        self.replace = replace
        self.backward = backward
        self.max_calls, self.match, self.every, self.max_bytes = max_calls, match, every, max_bytes
        self.notify = notify or _stderr
        self.lock = threading.Lock()
        self.seen = self.matched = self.captured = self.skipped = self.bytes = 0
        self.stopped: str | None = None
        self.occurrences: Counter[str] = Counter()
        self.cases: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []
        self.summary: Summary | None = None
        self.torch: Any = None
        self.interceptor: Interceptor | None = None
        self.gradients: Gradients | None = None
        self.graded = 0
        """Calls whose gradients joined their file."""
        self.reserved = 0
        """The bytes the gradients of the calls awaiting them will add."""
        self.awaiting: dict[int, _Awaiting] = {}
        self.case_items: list[bytes] = []
        self.call_items: list[bytes] = []
        self.changed = False
        """Gradients joined a case since the documents were last rewritten."""

    # --- start and end --------------------------------------------------------------------

    def __enter__(self) -> Capture:
        torch = _import_torch()
        with _LOCK:
            if _RUNNING:
                raise SpecError("capture", "a capture is already running; captures do not nest")
            self._prepare_folder()
            self.torch = torch
            self.interceptor = Interceptor(torch, self._on_call)
            if self.backward:
                self.gradients = Gradients(torch, self._gradients_arrived, self._pass_ended)
            self.interceptor.install()
            _RUNNING.append(self)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with _LOCK:
            assert self.interceptor is not None
            self.interceptor.remove()
            _RUNNING.remove(self)
        if self.gradients is not None:
            # a backward pass cut short (an exception in it): what arrived is kept
            for number, got in sorted(self.gradients.release().items()):
                self._gradients_arrived(number, got)
        with self.lock:
            manifest = write_documents(
                self.folder, self.cases, self.calls, self._counts(), self.shown
            )
            self.summary = Summary(
                self.seen,
                self.captured,
                self.skipped,
                self.bytes,
                self.shown,
                None if manifest is None else self.shown / manifest.name,
                self.stopped,
                None if self.gradients is None else self.graded,
            )

    def _prepare_folder(self) -> None:
        # at the start: the folder as given is the folder meant, and names it in messages
        label = str(self.shown)
        if self.shown.exists() and not self.shown.is_dir():
            raise InputError(label, "is a file; expected a directory")
        if (self.shown / "manifest.yaml").exists() or (self.shown / TENSORS).exists():
            if not self.replace:
                raise InputError(
                    label,
                    "already holds a capture (manifest.yaml or tensors/); remove it, pick "
                    "another, or replace it (--replace)",
                )
            _remove_capture(self.shown)
        try:
            (self.shown / TENSORS).mkdir(parents=True)
        except OSError as exc:
            raise InputError(label, f"cannot be created: {exc.strerror or exc}") from None
        write_tokens(self.shown, self.tokens)

    def _counts(self) -> str:
        text = f"{self.captured} of {plural(self.seen, 'attention call')} captured"
        if self.skipped:
            text += f" ({self.skipped} cannot be replayed)"
        if self.gradients is not None:
            text += f"; {_with_gradients(self.graded)}"
        if self.stopped:
            text += "; stopped by max_bytes"
        return text

    # --- each call ------------------------------------------------------------------------

    def _on_call(self, module: Any, build: Callable[[], Call]) -> None:
        assert self.interceptor is not None
        with self.lock:
            self.seen += 1
            number = self.seen
            path = self.interceptor.path_of(module)
            name = self._name(module, path, number)
            if not self._wanted(name):
                return
            call = build()
            describe_layer(call, module, self.torch)
            problem = unwritable(call.tensors)
            if problem is not None:
                call.tensors = {}
                call.skip = f"{problem}; not written"
            self._record(call, number, name, path, module)

    def _name(self, module: Any, path: str | None, number: int) -> str:
        if module is None:
            return f"call-{number}"
        base = path or type(module).__name__  # the outermost module itself, or not in it
        self.occurrences[base] += 1
        count = self.occurrences[base]
        return base if count == 1 else f"{base}#{count}"

    def _wanted(self, name: str) -> bool:
        if self.stopped is not None:
            return False
        if self.max_calls is not None and self.captured >= self.max_calls:
            return False
        if self.match is not None and not _matches(name, self.match):
            return False
        self.matched += 1
        return (self.matched - 1) % self.every == 0

    def _record(self, call: Call, number: int, name: str, path: str | None, module: Any) -> None:
        stem = file_stem(number, name)
        file = f"{TENSORS}/{stem}.safetensors"
        metadata = {"name": name, "call": str(number), "source": call.source}
        size = full = 0
        hooked = self.gradients is not None and bool(call.tensors) and call.skip is None
        if call.tensors:
            size = len(safetensors_header(call.tensors, metadata)) + 8 + tensors_size(call.tensors)
            full = size
            if hooked and call.differentiable:
                like = {g: call.tensors[GRADIENTS[g]] for g in call.differentiable}
                full = grown_size(call.tensors, metadata, like)
            if self.max_bytes is not None and self.bytes + self.reserved + full > self.max_bytes:
                self.stopped = (
                    f"stopped at {plural(self.captured, 'call')} ({si(self.bytes, 'B')}): "
                    f"call {number} ({name}, {si(full, 'B')}) would pass max_bytes "
                    f"{si(self.max_bytes, 'B')}; later calls are not captured"
                )
                self.notify(self.stopped)
                return
            write_safetensors(self.folder / file, call.tensors, metadata, self.torch)
        self.captured += 1
        self.bytes += size
        layer = layer_of(path) if path else getattr(module, "layer_idx", None)
        entry: dict[str, Any] = {"call": number, "name": name}
        entry["file"] = file if call.tensors else None
        entry.update({"source": call.source, "module_path": path, "layer": layer})
        entry.update(call.info)
        entry["options"] = dict(call.options)
        entry["bytes"] = size
        if call.skip is not None:
            self.skipped += 1
            entry["skipped"] = call.skip
        else:
            description = case_description(call, number, layer)
            self.cases.append(manifest_case(name, file, call.tensors, call.options, description))
        self.calls.append(entry)
        # On disk at once: a program that ends without unwinding (os._exit, a crash in
        # native code) leaves every call it made checkable; the end rewrites them whole.
        case = self.cases[-1] if call.skip is None else None
        record_progress(self.folder, case, entry, self.shown)
        if self.gradients is None:
            return
        # kept as written: a backward pass rewrites the documents from them
        self.call_items.append(list_item(entry))
        if case is not None:
            self.case_items.append(list_item(case))
        if hooked and self.gradients.watch(number, call):
            self.reserved += full - size
            at_case = len(self.cases) - 1 if case is not None else None
            self.awaiting[number] = _Awaiting(len(self.calls) - 1, at_case, file, full - size)

    # --- each call's gradients ------------------------------------------------------------

    def _gradients_arrived(self, number: int, got: dict[str, Any]) -> None:
        """Call ``number``'s gradients join its file, its entry and its case."""
        with self.lock:
            awaiting = self.awaiting.pop(number, None)
            if awaiting is None or self.summary is not None:  # the documents are final
                return
            self.reserved -= awaiting.reserve
            entry = self.calls[awaiting.call]
            tensors = {g: got[g] for g in GRADIENTS if g in got}
            size = add_safetensors(self.folder / awaiting.file, tensors, self.torch)
            self.bytes += size - entry["bytes"]
            entry["bytes"] = size
            entry["gradients"] = list(tensors)
            self.graded += 1
            if awaiting.case is not None:
                case = with_gradients(self.cases[awaiting.case], awaiting.file, tensors)
                self.cases[awaiting.case] = case
                self.case_items[awaiting.case] = list_item(case)
            self.call_items[awaiting.call] = list_item(entry)
            self.changed = True

    def _pass_ended(self) -> None:
        """A backward pass ended: the documents list the gradients it brought."""
        with self.lock:
            if not self.changed or self.summary is not None:
                return
            self.changed = False
            rewrite_progress(self.folder, self.case_items, self.call_items, self.shown)


@dataclass(frozen=True)
class _Awaiting:
    """A recorded call whose gradients have not come: where its entry and case are in
    the documents (by index), its file, and the bytes reserved for them."""

    call: int
    case: int | None
    file: str
    reserve: int


def _matches(name: str, pattern: str) -> bool:
    """A glob (with ``*``, ``?`` or ``[``) matches the whole name; other text is a substring."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern in name


def _import_torch() -> Any:
    try:
        import torch  # imported here: the capture alone needs it, an optional extra
    except ImportError:
        raise SpecError(
            "capture", f"needs PyTorch, which is not installed; install it with {INSTALL_TORCH}"
        ) from None
    return torch


def _absolute(folder: Path) -> Path:
    """``folder`` made absolute now (the program may change directory before its calls,
    as Hydra does); as given when the working directory is gone."""
    try:
        return folder.absolute()
    except FileNotFoundError:
        return folder


def _remove_capture(folder: Path) -> None:
    """An earlier capture's files, and nothing else: ``manifest.yaml``, ``calls.yaml``
    and the ``.safetensors`` and ``.yaml`` files of ``tensors/`` (the folder itself when
    it is then empty). Anything else there stops the replacement, untouched.

    Raises:
        InputError: something else is in ``tensors/``, or a file cannot be removed.
    """
    tensors = folder / TENSORS
    if tensors.is_symlink() or (tensors.exists() and not tensors.is_dir()):
        raise InputError(str(tensors), "is not a folder of a capture's tensors; not replaced")
    others = [
        p
        for p in (tensors.iterdir() if tensors.exists() else ())
        if p.suffix not in (".safetensors", ".yaml") or not p.is_file() or p.is_symlink()
    ]
    if others:
        raise InputError(
            str(others[0]), "is not a capture's tensor file; the capture is not replaced"
        )
    try:
        for p in tensors.iterdir() if tensors.exists() else ():
            p.unlink()
        if tensors.exists():
            tensors.rmdir()
        for name in ("manifest.yaml", "calls.yaml", TOKENS_FILE):
            path = folder / name
            if path.is_file() and not path.is_symlink():
                path.unlink()
    except OSError as exc:
        raise InputError(str(folder), f"cannot be replaced: {exc.strerror or exc}") from None


def capture(
    out: str | Path,
    max_calls: int | None = None,
    match: str | None = None,
    every: int = 1,
    max_bytes: int | str | None = None,
    *,
    notify: Callable[[str], None] | None = None,
    replace: bool = False,
    backward: bool = False,
    tokens: Sequence[str] | None = None,
) -> Capture:
    """Record every attention call made inside the ``with`` block into the folder ``out``.

    Every call of ``torch.nn.functional.scaled_dot_product_attention`` (whoever makes it)
    and of Hugging Face transformers' eager attention becomes ``out/tensors/NNNNN-NAME
    .safetensors`` (``q``, ``k``, ``v``, ``mask``, ``output``, ``weights``), and a case of
    ``out/manifest.yaml``, which ``sdpa check --manifest`` runs as it is; ``out/calls.yaml``
    says where each call came from. Outputs are the same, bit for bit, with or without it.

    Example::

        with capture("runs/llama", max_bytes=2 << 30) as cap:
            model(**batch)
        print(cap.summary.line())

    Args:
        out: the folder; made if needed, refused if it already holds a capture (unless
            ``replace``).
        max_calls: record at most this many calls.
        match: record only calls whose name (``model.layers.3.self_attn``, ``call-7``)
            matches this glob, or contains this text.
        every: record every ``every``-th call (of those ``match`` selects).
        max_bytes: stop, with one line on stderr, before the files would pass this size
            (bytes, or text such as ``"2GiB"``).
        notify: where that line goes (default: stderr).
        replace: replace an earlier capture in ``out`` (its manifest, ``calls.yaml``
            and tensor files; anything else there refuses it).
        backward: also record each call's gradients when the program runs a backward
            pass inside the ``with`` block: dO and the gradients of Q, K, V join the
            call's file (``dout``, ``dq``, ``dk``, ``dv``) and its case
            (``dout``, ``expect-dq``, ``expect-dk``, ``expect-dv``). The program's
            gradients are unchanged.
        tokens: a label for each position (the tokenizer's tokens of the sequence
            run), written to ``out/tokens.json``: ``sdpa report model out/manifest.yaml
            --html`` labels the patterns' axes with them.

    Raises:
        SpecError: PyTorch is not installed, a capture is already running, or a bound is
            not a positive integer.
        InputError: ``out`` cannot be made, or already holds a capture.
    """
    return Capture(
        out,
        max_calls=max_calls,
        match=match,
        every=every,
        max_bytes=max_bytes,
        notify=notify,
        replace=replace,
        backward=backward,
        tokens=tokens,
    )
