"""``sdpa check --manifest M --cluster ADDRESS``: the cases of a manifest as tasks on a
Dask distributed cluster, one task per case (:func:`~sdpa_cli.api.judge.run_case`),
results in manifest order: the same :class:`~sdpa_cli.check.records.CaseResult` list a
local run gives, so the same reports and exit codes.

Files are read where the workers run: a path relative to the manifest is made absolute
here (against this process's working directory), so workers on this machine, or on
machines sharing its file system at the same place, read the same files whatever
folder they were started in; a URL is read by the worker, with fsspec
(:mod:`~sdpa_cli.files.remote`). Dask pickles the tasks' arguments and results, our
own dataclasses; no file's content is ever unpickled.

Dask is an optional extra (``pip install 'dask[distributed]'``), imported on use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sdpa_cli.api.case import Case, names_a_file
from sdpa_cli.api.judge import run_case
from sdpa_cli.check.records import CaseResult
from sdpa_cli.check.settings import Overrides
from sdpa_cli.errors import SpecError
from sdpa_cli.files.limits import keep_freed_blocks
from sdpa_cli.files.remote import is_url
from sdpa_cli.text import one_line, printable

CONNECT_TIMEOUT = 5.0
"""Seconds to wait for the scheduler before giving up (``--cluster-timeout``)."""
MISSING_EXTRA = "--cluster needs Dask: pip install 'dask[distributed]'"


def run_cases_on_cluster(
    cases: list[Case],
    over: Overrides,
    address: str,
    *,
    timeout: float = CONNECT_TIMEOUT,
) -> list[CaseResult]:
    """Every case as a task on the cluster whose scheduler is at ``address``
    (``tcp://host:port``), in manifest order.

    A case that raises on a worker, or whose worker dies, is that case's error (exit 2);
    the others still run.

    Raises:
        SpecError: Dask is not installed; ``address`` is not a scheduler address, or no
            scheduler answers there within ``timeout`` seconds.
    """
    try:
        import distributed  # optional extra: dask
        from distributed.comm.addressing import get_address_host_port  # optional extra: dask
    except ImportError:
        raise SpecError("", MISSING_EXTRA) from None
    shown = printable(address)
    try:
        # Checked first: a Client refused for a malformed address says so again, with
        # a traceback, when it is collected.
        get_address_host_port(address)
    except (ValueError, NotImplementedError) as exc:
        raise SpecError(
            "--cluster",
            f"{shown} is not a scheduler address ({one_line(exc)}); expected tcp://HOST:PORT",
        ) from None
    try:
        client = distributed.Client(address, timeout=timeout, set_as_default=False)  # type: ignore[no-untyped-call]
    except (OSError, TimeoutError) as exc:
        detail = "" if str(exc).startswith("Timed out") else f" ({one_line(exc)})"
        raise SpecError(
            "--cluster", f"no scheduler answers at {shown} within {timeout:g} s{detail}"
        ) from None
    except Exception as exc:  # TLS without its configuration, and the like
        raise SpecError(
            "--cluster", f"cannot connect to {shown}: {type(exc).__name__}: {one_line(exc)}"
        ) from None
    with client:
        futures = [client.submit(run_on_worker, _absolute(c), over, pure=False) for c in cases]
        return [_result(case, future) for case, future in zip(cases, futures, strict=True)]


def run_on_worker(case: Case, over: Overrides) -> CaseResult:
    """One case as a task on a Dask worker: the worker's glibc first told to keep freed
    blocks (Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536, and a case
    ran 1.5× slower than in a local process), then :func:`run_case`."""
    keep_freed_blocks()
    return run_case(case, over)


def _result(case: Case, future: Any) -> CaseResult:
    """A task's result; what the cluster raised instead (a worker that died, one that
    cannot import sdpa_cli) as the case's error."""
    try:
        result = future.result()
    except Exception as exc:
        return CaseResult(
            case.title(None), error=f"failed on the cluster: {type(exc).__name__}: {one_line(exc)}"
        )
    if not isinstance(result, CaseResult):  # a worker running another sdpa_cli
        return CaseResult(
            case.title(None),
            error=f"failed on the cluster: a worker returned {type(result).__name__}",
        )
    return result


def _absolute(case: Case) -> Case:
    """``case`` with its relative paths made absolute against this process's working
    directory (workers run elsewhere); URLs and absolute paths as they are."""

    def fix(path: str) -> str:
        return path if is_url(path) or Path(path).is_absolute() else str(Path.cwd() / path)

    def fix_map(paths: Mapping[str, str]) -> dict[str, str]:
        return {k: fix(p) if names_a_file(k, p) else p for k, p in paths.items()}

    return dataclasses.replace(
        case,
        inputs=tuple(fix(p) for p in case.inputs),
        tensors=fix_map(case.tensors),
        expect=fix_map(case.expect),
        partials=None if case.partials is None else fix(case.partials),
        root=None if case.root is None else fix(case.root),
    )
