"""A local Dask cluster for the manifest figure, started and stopped by the benchmark.

The cluster runs in its own process (and session): `distributed.LocalCluster` with 2
worker processes of 1 thread each on 127.0.0.1, no dashboard. It prints the scheduler's
address and sleeps; the benchmark waits until the address accepts connections, and on
leaving sends SIGINT (the cluster closes its workers), then SIGKILL to the session it
started if that has not ended within a while.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

CLUSTER_SCRIPT = """\
import sys, time
from distributed import LocalCluster

if __name__ == "__main__":
    cluster = LocalCluster(n_workers=int(sys.argv[1]), threads_per_worker=1, processes=True,
                           host="127.0.0.1", dashboard_address=None)
    print(cluster.scheduler_address, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()
"""

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def unavailable(sdpa: str) -> str | None:
    """Why the cluster figure cannot be measured here, or None."""
    probe = subprocess.run(
        [sys.executable, "-c", "import distributed"], capture_output=True, check=False
    )
    if probe.returncode != 0:
        return "dask not installed (pip install 'dask[distributed]')"
    helped = subprocess.run([sdpa, "check", "--help"], capture_output=True, text=True, check=False)
    if "--cluster" not in helped.stdout:
        return "sdpa check has no --cluster"
    return None


def _accepts(address: str) -> bool:
    parts = urlsplit(address)
    if parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=1.0):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def local_cluster(workers: int = 2) -> Iterator[str]:
    """Start a local cluster; yields its scheduler address (tcp://127.0.0.1:PORT)."""
    with tempfile.TemporaryDirectory(prefix="sdpa-bench-cluster-") as tmp:
        script = Path(tmp) / "cluster.py"
        script.write_text(CLUSTER_SCRIPT)
        with open(Path(tmp) / "cluster.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, str(script), str(workers)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=tmp,
                start_new_session=True,
            )
            try:
                yield _wait_for_address(proc, Path(tmp) / "cluster.log")
            finally:
                _stop(proc)


def _wait_for_address(proc: subprocess.Popen[bytes], log: Path) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            why = "exited" if proc.poll() is not None else f"no address in {START_TIMEOUT_S:.0f} s"
            raise RuntimeError(f"the local cluster {why}: {log.read_text()[-500:]}")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                continue
            line += chunk
    address = line.decode().strip()
    while not _accepts(address):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the local cluster at {address} does not accept connections")
        time.sleep(0.2)
    return address


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # Still running (so its process group is still its own): end the session
            # it started, the workers included.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
