"""Manifests: many cases (every layer of a model dump), each one
:class:`~sdpa_cli.api.case.Case`, run through the same runner as one case given
directly (:func:`~sdpa_cli.api.judge.run_case`); ``sdpa check --manifest``.

A manifest is a YAML or JSON mapping::

    defaults:            # optional: options and check settings for every case
      causal: true
      rtol: 1e-3
      atol: 1e-3
    cases:
      - name: layer0     # optional; default case-1, case-2, ...
        q: dump/l0_q.npy # or  case: l0.yaml  (a case file holding q, k, v, options)
        k: dump/l0_k.npy
        v: dump/l0_v.npy
        expect-output: dump/l0_out.npy
        scale: 0.125     # any option of compute, any setting of check
      - name: layer1
        case: dump/l1.yaml
        expect-partials: dump/l1_partials.yaml  # split-KV partials, as --expect-partials
        decode: true     # also against its tokens decoded one by one, as --decode

Paths are relative to the manifest; a URL (``s3://...``, ``file://...``, anything
fsspec knows) is read as it is, with fsspec (q, k, v, bias, mask, sinks and the exports; a
case file is read from the local file system). Cases run in parallel processes, or on
a Dask cluster (:mod:`~sdpa_cli.api.cluster`); a case that fails, or cannot be read,
does not stop the others.

``--shard I/N`` runs one share of the cases (:class:`Shard`): round robin, the cases
at positions I, I+N, I+2N, ... (1-based), so every case is in exactly one of the N
shards, the shards' sizes differ by at most one, and a shard's cases are spread over
the manifest (a model dump's later, larger layers are not all in one shard). A shard's
report carries the :func:`fingerprint` of the run, by which merging knows the shards
of one run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import signal
import sys
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdpa_cli.api.case import Case, names_a_file
from sdpa_cli.api.judge import run_case as run_case  # workers run it: a test replaces it here
from sdpa_cli.check.records import CaseResult
from sdpa_cli.check.settings import CHECK_NAMES, Overrides, check_values, merge_check_settings
from sdpa_cli.engine.options import OPTION_NAMES, parse_bool
from sdpa_cli.errors import InputError, SpecError
from sdpa_cli.files.confine import confine
from sdpa_cli.files.loaders import Source
from sdpa_cli.files.remote import is_url
from sdpa_cli.files.structured import TEXT_SUFFIXES, parse_text
from sdpa_cli.names import EXPORTS, INPUT_TENSORS
from sdpa_cli.text import as_typed, printable, shown

INPUT_KEYS = ("case", *INPUT_TENSORS)
"""A case's inputs: a case file, or Q, K, V and the other tensors, each a file."""
EXPECT_KEYS = {f"expect_{name}": name for name in EXPORTS}
"""A case's exports to judge, each a file."""
PATH_KEYS = (*INPUT_KEYS, *EXPECT_KEYS, "expect_partials", "dout")
"""Every key whose value is a file path, read relative to the manifest."""
TEXT_KEYS = ("name", "description")


def _entries(
    data: Mapping[Any, Any], where: str, base: Path
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], dict[str, Any]]:
    """Split one mapping into paths and texts (name, description, decode), options
    and check settings."""
    paths: dict[str, Any] = {}
    options: dict[str, Any] = {}
    option_where: dict[str, str] = {}
    check: dict[str, Any] = {}
    known = {*PATH_KEYS, *TEXT_KEYS, "decode", *OPTION_NAMES, *CHECK_NAMES}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key not in known:
            raise InputError(
                f"{where}: {printable(str(raw_key))}",
                "unknown key; expected name, case or q/k/v, "
                + ", ".join(n.replace("_", "-") for n in INPUT_TENSORS[3:])
                + ", expect-output, expect-weights, expect-lse, "
                "expect-dq, expect-dk, expect-dv, expect-dbias, expect-dsinks, dout, "
                "expect-partials, decode, an option of compute or a setting of check",
            )
        number = isinstance(value, (int, float, str)) and not isinstance(value, bool)
        if number and not names_a_file(key, str(value)):
            paths[key] = repr(float(value))  # a descale given as a number, not a file
        elif key in PATH_KEYS:
            if not isinstance(value, str):
                raise InputError(f"{where}: {raw_key}", f"expected a file path, got {shown(value)}")
            if is_url(value) and key in ("case", "expect_partials"):
                listed = "q, k and v" if key == "case" else "its outputs and LSEs"
                raise InputError(
                    f"{where}: {raw_key}",
                    f"a {'case file' if key == 'case' else 'partials list'} is read from the "
                    f"local file system; list {listed} as URLs",
                )
            named = Source.parse(value, base).path if not is_url(value) else value
            confine(value, named, base, f"{where}: {raw_key}")
            paths[key] = value if is_url(value) else str(base / Path(value).expanduser())
        elif key in TEXT_KEYS:
            paths[key] = str(value)
        elif key == "decode":
            paths[key] = parse_bool(value, f"{where}: {raw_key}")
        elif key in CHECK_NAMES:
            check.update(check_values({raw_key: value}, where))
        else:
            options[key] = value
            option_where[key] = f"{where}: {raw_key}"
    return paths, options, option_where, check


def load_manifest(path: str) -> list[Case]:
    """Read and validate a manifest; nothing is run and no tensor is loaded.

    Raises:
        InputError: naming the manifest (and the entry) when it is not well formed.
    """
    file = Path(path)
    path = printable(path)  # as messages name it
    fmt = TEXT_SUFFIXES.get(file.suffix.lower())
    if fmt is None:
        raise InputError(path, "a manifest is a .yaml, .yml or .json file")
    data = parse_text(file, fmt, path)
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise InputError(path, "a manifest is a mapping with a list of cases under 'cases'")
    unknown = [str(k) for k in data if k not in ("cases", "defaults")]
    if unknown:
        raise InputError(path, f"unknown key {shown(unknown[0])}; expected cases and defaults")
    if not data["cases"]:
        raise InputError(path, "lists no cases")
    base = file.parent
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise InputError(f"{path}: defaults", "must be a mapping of options and settings")
    d_paths, d_options, d_where, d_check = _entries(defaults, f"{path}: defaults", base)
    cases: list[Case] = []
    names: set[str] = set()
    for n, entry in enumerate(data["cases"], start=1):
        where = f"{path}: cases[{n}]"
        if not isinstance(entry, dict):
            raise InputError(where, "must be a mapping (q, k, v or case, expect-..., options)")
        paths, options, option_where, check = _entries(entry, where, base)
        paths = {**d_paths, **paths}
        name = _case_name(paths.pop("name", None), n)
        paths.pop("description", None)
        if name in names:
            raise InputError(where, f"the name {name!r} is used twice")
        names.add(name)
        if "case" in paths:
            if any(k in paths for k in ("q", "k", "v")):
                raise InputError(where, "give either case or q, k and v, not both")
            inputs: tuple[str, ...] = (paths["case"],)
        else:
            missing = [k for k in ("q", "k", "v") if k not in paths]
            if missing:
                raise InputError(where, f"needs q, k and v (or case); missing {', '.join(missing)}")
            inputs = (paths["q"], paths["k"], paths["v"])
        cases.append(
            Case(
                inputs=inputs,
                tensors={k: paths[k] for k in INPUT_TENSORS[3:] if k in paths},
                options={**d_options, **options},
                where={**d_where, **option_where},
                expect={EXPECT_KEYS[k]: p for k, p in paths.items() if k in EXPECT_KEYS},
                partials=paths.get("expect_partials"),
                dout=paths.get("dout"),
                decode=bool(paths.get("decode", False)),
                check=merge_check_settings(d_check, check),
                name=name,
                root=str(base),
            )
        )
    return cases


def manifest_names(path: str) -> list[str]:
    """The names of a manifest's cases in order (``case-N`` where none is given), as its
    reports name them; nothing else of it is checked (a merge verifies its shards
    against them, wherever the cases' files are).

    Raises:
        InputError: a file that is not a manifest.
    """
    file = Path(path)
    label = printable(path)
    data = parse_text(file, TEXT_SUFFIXES.get(file.suffix.lower(), "yaml"), label)
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list):
        raise InputError(label, "a manifest is a mapping with a list of cases under 'cases'")
    given_defaults = data.get("defaults")
    defaults: dict[Any, Any] = given_defaults if isinstance(given_defaults, dict) else {}
    return [
        _case_name(entry.get("name", defaults.get("name")) if isinstance(entry, dict) else None, n)
        for n, entry in enumerate(data["cases"], start=1)
    ]


def _case_name(given: Any, n: int) -> str:
    """Case ``n``'s name (its entry's, else its defaults'; ``case-N`` where neither
    gives one), printable: it heads error lines and reports."""
    return printable(str(given if given is not None else f"case-{n}"))


WORKER_DIED = (
    "its worker process was killed (by the system, for lack of memory, or by a signal); "
    "the other cases ran"
)


def run_cases(cases: list[Case], over: Overrides, jobs: int) -> list[CaseResult]:
    """Every case, in manifest order, ``jobs`` at a time in separate processes.

    A worker that dies (the OOM killer) breaks the pool and every case it had not
    finished: each of those runs again alone in a fresh pool, so that only the case
    that kills its worker gets an error row (:data:`WORKER_DIED`) and the others
    their results. Interrupted (Ctrl-C, SIGTERM), the workers are ended with the run.
    """
    jobs = max(1, min(jobs, len(cases)))
    if jobs == 1:
        return [run_case(c, over) for c in cases]
    results: dict[int, CaseResult] = {}
    for i in _run_in_pool(cases, range(len(cases)), over, jobs, results):
        if _run_in_pool(cases, [i], over, 1, results):
            results[i] = CaseResult(cases[i].name, error=WORKER_DIED)
    return [results[i] for i in range(len(cases))]


def _run_in_pool(
    cases: list[Case],
    indices: Iterable[int],
    over: Overrides,
    jobs: int,
    results: dict[int, CaseResult],
) -> list[int]:
    """Run the cases at ``indices`` in a new pool of ``jobs`` processes, their results
    into ``results``; returns the indices of those left unfinished by a dead worker."""
    pool = ProcessPoolExecutor(max_workers=jobs, initializer=_start_worker, initargs=(os.getpid(),))
    broken: list[int] = []
    try:
        futures: dict[int, Future[CaseResult] | None] = {}
        # Workers are forked in submit: a SIGTERM raised amid a fork's hooks would be
        # lost ("Exception ignored"), so it waits until they are done.
        with _signals_held():
            for i in indices:
                try:
                    futures[i] = pool.submit(run_case, cases[i], over)
                except BrokenProcessPool:  # a worker died already: the rest waits its turn
                    futures[i] = None
        for i, future in futures.items():
            try:
                if future is None:
                    raise BrokenProcessPool
                results[i] = future.result()
            except BrokenProcessPool:
                broken.append(i)
    except BaseException:
        _end_workers(pool)  # Ctrl-C, SIGTERM: stop now, do not wait for running cases
        raise
    pool.shutdown()
    return broken


HELD_SIGNALS = frozenset(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name)
)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGTERM and SIGHUP delivered only at the end of the block (where the platform
    can hold them)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


def _end_workers(pool: ProcessPoolExecutor) -> None:
    """Cancel what has not started and terminate the workers running the rest."""
    # Python 3.14 has terminate_workers(); before it, the pool's own process table.
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            process.terminate()
    # The pool's manager thread closes its wake-up pipe as the workers die: wait for it,
    # or the interpreter's exit hook may write to the pipe while it closes (EBADF, an
    # "Exception ignored" traceback on stderr after the one line).
    manager = getattr(pool, "_executor_manager_thread", None)
    if manager is not None:
        manager.join(timeout=1.0)


def _start_worker(parent: int) -> None:
    """Set up a worker process: SIGTERM and SIGHUP end it (the parent's handlers,
    inherited through fork, would raise inside a case), Ctrl-C is the parent's to
    handle, and on Linux it dies with its parent (PR_SET_PDEATHSIG), even a parent
    killed with SIGKILL."""
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # forked while the parent held them
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # imported here: only Linux workers need it

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl: nothing to work for
        os._exit(1)


# --- shards -----------------------------------------------------------------------------

_SHARD_PATTERN = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based): the cases at positions ``index``,
    ``index + count``, ... of the manifest (round robin)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``I/N`` with 1 ≤ I ≤ N.

        Raises:
            SpecError: naming ``--shard``.
        """
        match = _SHARD_PATTERN.fullmatch(text)
        if match is None:
            raise SpecError("--shard", f"expected I/N (such as 2/4), got {as_typed(text)}")
        index, count = int(match[1]), int(match[2])
        if not 1 <= index <= count:
            raise SpecError("--shard", f"expected I/N with 1 ≤ I ≤ N, got {index}/{count}")
        return cls(index, count)

    def positions(self, total: int) -> list[int]:
        """The 1-based positions, in a manifest of ``total`` cases, of this shard's
        cases (none when the manifest has fewer cases than ``index``)."""
        return list(range(self.index, total + 1, self.count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


SHARD_KEY = "shard"
"""The key of a shard's report that says which shard it is, after ``manifest``."""


def shard_document(
    document: dict[str, Any], shard: Shard, *, total: int, fingerprint: str
) -> dict[str, Any]:
    """A manifest's JSON report of one shard's cases, with ``shard`` after ``manifest``.

    Args:
        document: :func:`~sdpa_cli.report.check_document` of the shard's cases.
        total: the number of cases in the manifest.
        fingerprint: :func:`~sdpa_cli.api.manifest.fingerprint` of the run.
    """
    block = {
        "index": shard.index,
        "count": shard.count,
        "manifest_cases": total,
        "positions": shard.positions(total),
        "fingerprint": fingerprint,
    }
    out: dict[str, Any] = {}
    for key, value in document.items():
        out[key] = value
        if key == "manifest":
            out[SHARD_KEY] = block
    return out


def fingerprint(cases: list[Case], over: Overrides) -> str:
    """``sha256:…`` of a run: the manifest's cases as read (names, paths, options,
    settings) and what the command line adds to every case. The shards of one run
    share it; a shard of another manifest, or run with other flags, does not."""
    data = {
        "cases": [dataclasses.asdict(c) for c in cases],
        "overrides": dataclasses.asdict(over),
    }
    text = json.dumps(data, sort_keys=True, default=repr)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
