"""SIGTERM and SIGHUP end a run as Ctrl-C does: one line, exit 128 + the signal, no
temporary file left, the target untouched, no worker process left; a worker killed
by the system (the OOM killer) is an error row for its case, not the end of the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from clirunner import CLEAN_ENV, invoke, sdpa_executable, strict_json

from sdpa_cli.api import manifest
from sdpa_cli.api.case import Case
from sdpa_cli.api.manifest import WORKER_DIED
from sdpa_cli.check.records import CaseResult
from sdpa_cli.check.settings import Overrides
from sdpa_cli.errors import ExitCode

posix = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def start(args: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env["COLUMNS"] = "80"
    return subprocess.Popen(
        [sdpa_executable(), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def wait_for(found: Callable[[], object], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not found():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def temporaries(d: Path) -> list[Path]:
    return [p for p in d.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.e2e
@posix
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_signal_during_save_removes_the_temporary(workdir: Path, signum: int) -> None:
    """The JSON document fills the pipe nobody reads, so the run is caught with its
    --save temporary on disk, whatever the machine's speed."""
    rng = np.random.default_rng(3)
    for name in "qkv":
        np.save(workdir / f"{name}.npy", rng.standard_normal((2, 256, 16)))
    (workdir / "out.npz").write_bytes(b"the previous run")
    proc = start(
        ["compute", "q.npy", "k.npy", "v.npy", "--format", "json", "--save", "out.npz"], workdir
    )
    wait_for(lambda: temporaries(workdir), proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum
    assert err.decode() == f"sdpa: error: interrupted ({signal.Signals(signum).name})\n"
    assert temporaries(workdir) == []
    assert (workdir / "out.npz").read_bytes() == b"the previous run"


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie is dead, waiting for its reaper


@pytest.mark.e2e
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_the_workers_end_with_their_parent(workdir: Path, signum: int) -> None:
    """SIGTERM: the parent terminates them on its way out; SIGKILL (no way out): they
    die with it (PR_SET_PDEATHSIG). Both left them computing their cases (seconds
    each here, minutes in a model's dump); now they are gone within 2 s."""
    rng = np.random.default_rng(4)
    for name in "qkv":
        np.save(workdir / f"{name}.npy", rng.standard_normal((8, 2048, 64)))
    cases = "".join(f"  - {{name: c{n}, q: q.npy, k: k.npy, v: v.npy}}\n" for n in range(4))
    (workdir / "m.yaml").write_text("cases:\n" + cases)
    proc = start(["check", "--manifest", "m.yaml", "--jobs", "2", "--report", "r.json"], workdir)
    wait_for(lambda: len(children(proc.pid)) == 2, proc)
    workers = children(proc.pid)
    time.sleep(0.5)  # each is computing its first case
    proc.send_signal(signum)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - sent < 3  # it did not wait for the cases to end
    if signum == signal.SIGTERM:
        assert proc.returncode == 143
        assert err == b"sdpa: error: interrupted (SIGTERM)\n"
        assert temporaries(workdir) == []
    deadline = time.monotonic() + 2
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers)
    assert not (workdir / "r.json").exists()


real_run_case = manifest.run_case


def run_case_or_die(case: Case, over: Overrides) -> CaseResult:
    """run_case, except that the case named ``boom`` has its worker killed, as the
    OOM killer would."""
    if case.name == "boom":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_run_case(case, over)


@posix
def test_worker_killed_by_the_system_is_an_error_row(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(5)
    for name in "qkv":
        np.save(workdir / f"{name}.npy", rng.standard_normal((2, 3, 4)))
    names = ["a", "b", "boom", "c", "d"]
    cases = "".join(f"  - {{name: {n}, q: q.npy, k: k.npy, v: v.npy}}\n" for n in names)
    (workdir / "m.yaml").write_text("cases:\n" + cases)
    monkeypatch.setattr(manifest, "run_case", run_case_or_die)
    result = invoke("check", "--manifest", "m.yaml", "--jobs", "2", "--format", "json")
    assert result.exit_code == ExitCode.BAD_INPUT, result.stderr
    assert result.stderr == f"sdpa: error: boom: {WORKER_DIED}\n"
    rows = {c["name"]: c for c in strict_json(result.stdout)["cases"]}
    assert list(rows) == names
    assert rows["boom"]["error"] == WORKER_DIED
    assert all(rows[n]["passed"] for n in names if n != "boom"), rows
