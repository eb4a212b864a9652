"""``sdpa check --manifest M --cluster ADDRESS``: a real Dask scheduler and two worker
processes on 127.0.0.1 (one cluster for the module) run a manifest's cases with the
same reports and exit codes as local processes; ``file://`` inputs; an unreachable or
malformed address, and no Dask at all, are one line and exit 2."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from clirunner import assert_one_error_line, invoke, strict_json
from manifest_cases import write_manifest

from sdpa_cli.api.case import Case
from sdpa_cli.api.cluster import MISSING_EXTRA, _result
from sdpa_cli.check.records import CaseResult
from sdpa_cli.check.settings import Overrides
from sdpa_cli.errors import ExitCode


@pytest.fixture(scope="module")
def scheduler() -> Iterator[str]:
    """The address of a local cluster: a scheduler and 2 worker processes, 1 thread each."""
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
    ) as cluster:
        yield cluster.scheduler_address


def run(manifest: Path | str, *args: str) -> Result:
    return invoke("check", "--manifest", str(manifest), *args)


def same_run(manifest: Path, scheduler: str, *args: str) -> tuple[Result, Result]:
    """The manifest run by local processes and on the cluster, with ``args``."""
    local = run(manifest, "--jobs", "2", *args)
    remote = run(manifest, "--cluster", scheduler, *args)
    assert "Traceback" not in local.output + remote.output
    return local, remote


@pytest.mark.parametrize("broken", [True, False])
def test_a_cluster_run_reports_as_a_local_run(tmp_path: Path, scheduler: str, broken: bool) -> None:
    manifest = write_manifest(tmp_path, broken=broken)
    local, remote = same_run(manifest, scheduler, "--format", "json")
    assert remote.exit_code == local.exit_code == (ExitCode.BAD_INPUT if broken else 1)
    assert strict_json(remote.stdout) == strict_json(local.stdout)
    assert remote.stderr == local.stderr
    doc = strict_json(remote.stdout)
    assert [c["name"] for c in doc["cases"]][:5] == [
        "good", "bad", "nan-key", "loose", "causal-wrong"
    ]  # fmt: skip
    local, remote = same_run(manifest, scheduler, "--junit", str(tmp_path / "r.xml"))
    assert remote.stdout == local.stdout  # the table


def test_a_cluster_runs_a_shard(tmp_path: Path, scheduler: str) -> None:
    manifest = write_manifest(tmp_path)
    local, remote = same_run(manifest, scheduler, "--shard", "2/3", "--format", "json")
    assert remote.exit_code == local.exit_code
    assert strict_json(remote.stdout) == strict_json(local.stdout)


def test_a_clusters_workers_compute_with_the_backend_asked_for(
    tmp_path: Path, scheduler: str
) -> None:
    """--backend travels with the cases: each worker computes with it (a GPU worker on
    its own device), and the verdicts are numpy's."""
    pytest.importorskip("torch")
    manifest = write_manifest(tmp_path)
    local = run(manifest, "--jobs", "2", "--format", "json")
    on_torch = run(manifest, "--cluster", scheduler, "--backend", "torch", "--format", "json")
    assert on_torch.exit_code == local.exit_code
    mine, theirs = strict_json(on_torch.stdout)["cases"], strict_json(local.stdout)["cases"]
    checked = [c for c in mine if c["error"] is None]
    assert checked
    assert {c["backend"] for c in checked} == {"torch"}
    assert {c["backend"] for c in theirs if c["error"] is None} == {"numpy"}
    for a, b in zip(mine, theirs, strict=True):
        assert a["passed"] == b["passed"], a["name"]
        assert [(c["name"], c["status"]) for c in a["checks"]] == [
            (c["name"], c["status"]) for c in b["checks"]
        ], a["name"]


def test_relative_paths_are_read_where_the_client_runs(workdir: Path, scheduler: str) -> None:
    """The workers were started in another folder: paths are made absolute for them."""
    write_manifest(workdir)
    result = run("m.yaml", "--cluster", scheduler, "--format", "json")
    doc = strict_json(result.stdout)
    assert result.exit_code == ExitCode.BAD_INPUT
    assert doc["manifest"] == "m.yaml"
    assert [c["passed"] for c in doc["cases"]] == [True, False, False, True, False, False]
    assert doc["cases"][-1]["error"] == f"{workdir / 'missing.npy'}: no such file"


def test_file_urls_are_read_on_the_workers(tmp_path: Path, scheduler: str) -> None:
    pytest.importorskip("fsspec")
    write_manifest(tmp_path)
    url = (tmp_path / "q.npy").as_uri()
    manifest = tmp_path / "urls.yaml"
    manifest.write_text(
        f"defaults: {{q: '{url}', k: k.npy, v: v.npy}}\n"
        "cases:\n"
        f"  - {{name: good, expect-output: '{(tmp_path / 'out.npy').as_uri()}'}}\n"
        f"  - {{name: bad, expect-output: '{(tmp_path / 'out_bad.npy').as_uri()}'}}\n"
        f"  - {{name: gone, q: '{(tmp_path / 'gone.npy').as_uri()}'}}\n"
    )
    # URLs leave the manifest's folder: a manifest from a pull request may not name them
    refused = same_run(manifest, scheduler)[0]
    assert "names a URL" in refused.stderr
    assert "--allow-outside" in refused.stderr
    local, remote = same_run(manifest, scheduler, "--format", "json", "--allow-outside")
    assert remote.exit_code == local.exit_code == ExitCode.BAD_INPUT
    doc = strict_json(remote.stdout)
    assert doc == strict_json(local.stdout)
    good, bad, gone = doc["cases"]
    assert (good["passed"], bad["passed"]) == (True, False)
    close = next(c for c in bad["checks"] if c["name"] == "output.close")
    assert close["file"] == (tmp_path / "out_bad.npy").as_uri()
    assert gone["error"] == f"{(tmp_path / 'gone.npy').as_uri()}: no such file"


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_an_unreachable_scheduler_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    manifest = write_manifest(tmp_path)
    address = f"tcp://127.0.0.1:{closed_port()}"
    result = run(manifest, "--cluster", address, "--cluster-timeout", "0.5")
    line = assert_one_error_line(result)
    assert line == f"sdpa: error: --cluster: no scheduler answers at {address} within 0.5 s"


@pytest.mark.parametrize("address", ["nowhere", "tcp://127.0.0.1", "nonsense://host:1"])
def test_a_malformed_address_is_one_line(tmp_path: Path, address: str) -> None:
    pytest.importorskip("distributed")
    manifest = write_manifest(tmp_path)
    line = assert_one_error_line(run(manifest, "--cluster", address))
    assert line.startswith(f"sdpa: error: --cluster: {address} is not a scheduler address (")
    assert line.endswith("); expected tcp://HOST:PORT")


def test_without_dask_cluster_says_which_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed: ImportError
    manifest = write_manifest(tmp_path)
    line = assert_one_error_line(run(manifest, "--cluster", "tcp://127.0.0.1:8786"))
    assert line == f"sdpa: error: {MISSING_EXTRA}"
    assert MISSING_EXTRA == "--cluster needs Dask: pip install 'dask[distributed]'"


def test_jobs_and_cluster_do_not_go_together(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path)
    line = assert_one_error_line(run(manifest, "--cluster", "tcp://127.0.0.1:1", "--jobs", "2"))
    assert (
        line == "sdpa: error: --jobs: the cluster's workers run the cases; give --jobs or --cluster"
    )


class _Raising:
    """A future whose task raised on the cluster (a worker died, or cannot import sdpa)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def result(self) -> Any:
        raise self.exc


def test_a_task_that_raises_is_its_cases_error() -> None:
    case = Case(name="layer3", inputs=("q.npy", "k.npy", "v.npy"))
    result = _result(case, _Raising(ModuleNotFoundError("No module named 'sdpa_cli'")))
    assert result.name == "layer3"
    assert result.report is None
    assert not result.internal  # exit 2: the cluster's fault, not sdpa's
    assert result.error == (
        "failed on the cluster: ModuleNotFoundError: No module named 'sdpa_cli'"
    )


def test_a_case_file_url_is_refused_in_a_manifest(tmp_path: Path) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text("cases:\n  - case: s3://bucket/case.yaml\n")
    line = assert_one_error_line(run(manifest))
    assert line == (
        f"sdpa: error: {manifest}: cases[1]: case: a case file is read from the local "
        "file system; list q, k and v as URLs"
    )


def test_a_task_keeps_freed_blocks_on_its_worker_before_it_runs_the_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=65536: every freed
    # block handed back to the system, a case 1.5x slower than in a local process
    from sdpa_cli.api import cluster

    calls: list[str] = []
    done = CaseResult("case")

    def run_case(case: Case, over: Any) -> CaseResult:
        calls.append(case.name)
        return done

    monkeypatch.setattr(cluster, "keep_freed_blocks", lambda: calls.append("malloc"))
    monkeypatch.setattr(cluster, "run_case", run_case)
    case = Case(name="case", inputs=("q.npy", "k.npy", "v.npy"))
    assert cluster.run_on_worker(case, Overrides()) is done
    assert calls == ["malloc", "case"]
