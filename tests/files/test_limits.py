"""Tests of sdpa_cli.files.limits: the memory a run may take is the least of
MemAvailable, the address space left under RLIMIT_AS and the cgroup's room."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdpa_cli.errors import InputError
from sdpa_cli.files import limits

GIB = 1 << 30


def fake_proc(
    tmp_path: Path, *, available_kib: int | None, vmsize_kib: int = 0, cgroup: str = "0::/\n"
) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    meminfo = "MemTotal:  99999999 kB\n"
    if available_kib is not None:
        meminfo += f"MemAvailable:   {available_kib} kB\n"
    (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "status").write_text(
        f"Name:\tpython\nVmPeak:\t1 kB\nVmSize:\t{vmsize_kib} kB\n"
    )
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def cgroup_files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture
def no_rlimit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        resource, "getrlimit", lambda _: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    )


def test_mem_available_alone(tmp_path: Path, no_rlimit: None) -> None:
    proc = fake_proc(tmp_path, available_kib=4 * 1024 * 1024)
    assert limits.available_memory(str(proc), str(tmp_path / "none")) == 4 * GIB


def test_nothing_known_is_none(tmp_path: Path, no_rlimit: None) -> None:
    proc = fake_proc(tmp_path, available_kib=None)
    assert limits.available_memory(str(proc), str(tmp_path / "none")) is None


def test_the_address_space_left_under_rlimit_as(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ulimit -v 3 GiB with 1 GiB of address space in use leaves 2 GiB, whatever MemAvailable
    says, less what BLAS and the threads' stacks and arenas take per core."""
    monkeypatch.setattr(resource, "getrlimit", lambda _: (3 * GIB, resource.RLIM_INFINITY))
    proc = fake_proc(tmp_path, available_kib=64 * 1024 * 1024, vmsize_kib=1024 * 1024)
    blas = limits.BLAS_ADDRESS_SPACE * (os.cpu_count() or 1)
    assert limits.available_memory(str(proc), str(tmp_path / "none")) == 2 * GIB - blas


def test_an_address_space_too_small_for_numpy_and_its_threads_is_refused(
    tmp_path: Path,
) -> None:
    """Below numpy's import and a BLAS buffer and malloc arena per thread, OpenBLAS's own
    malloc fails inside a product (exit 1, or a hang): refused before numpy loads."""
    proc = fake_proc(tmp_path, available_kib=None, vmsize_kib=50 * 1024)
    need = limits.NUMPY_ADDRESS_SPACE + 2 * limits.BLAS_ADDRESS_SPACE
    with pytest.raises(InputError, match=r"^ulimit -v: leaves 270 MiB of address space; sdpa "):
        limits.check_address_space(2, str(proc), limit=320 << 20)
    limits.check_address_space(2, str(proc), limit=need + (50 << 20))  # just enough
    limits.check_address_space(8, str(proc), limit=None)  # no limit known: nothing to say


def test_a_cgroup_v2_limit(tmp_path: Path, no_rlimit: None) -> None:
    proc = fake_proc(tmp_path, available_kib=64 * 1024 * 1024, cgroup="0::/ci/job\n")
    root = cgroup_files(
        tmp_path / "cg", {"ci/job/memory.max": f"{3 * GIB}\n", "ci/job/memory.current": f"{GIB}\n"}
    )
    assert limits.available_memory(str(proc), str(root)) == 2 * GIB


def test_a_cgroup_v2_limit_seen_at_the_root_inside_a_container(
    tmp_path: Path, no_rlimit: None
) -> None:
    proc = fake_proc(tmp_path, available_kib=64 * 1024 * 1024, cgroup="0::/kubepods/pod1\n")
    root = cgroup_files(
        tmp_path / "cg", {"memory.max": f"{GIB}\n", "memory.current": f"{GIB // 4}\n"}
    )
    assert limits.available_memory(str(proc), str(root)) == 3 * GIB // 4


def test_an_unlimited_cgroup_v2_is_ignored(tmp_path: Path, no_rlimit: None) -> None:
    proc = fake_proc(tmp_path, available_kib=1024, cgroup="0::/\n")
    root = cgroup_files(tmp_path / "cg", {"memory.max": "max\n", "memory.current": "5\n"})
    assert limits.available_memory(str(proc), str(root)) == 1024 * 1024


def test_a_cgroup_v1_limit(tmp_path: Path, no_rlimit: None) -> None:
    proc = fake_proc(
        tmp_path, available_kib=64 * 1024 * 1024, cgroup="4:memory:/docker/abc\n3:cpu:/\n"
    )
    root = cgroup_files(
        tmp_path / "cg",
        {
            "memory/docker/abc/memory.limit_in_bytes": f"{2 * GIB}\n",
            "memory/docker/abc/memory.usage_in_bytes": f"{GIB // 2}\n",
        },
    )
    assert limits.available_memory(str(proc), str(root)) == 3 * GIB // 2


def test_an_unlimited_cgroup_v1_is_ignored(tmp_path: Path, no_rlimit: None) -> None:
    proc = fake_proc(tmp_path, available_kib=1024 * 1024, cgroup="4:memory:/\n")
    root = cgroup_files(
        tmp_path / "cg",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",
            "memory/memory.usage_in_bytes": "1\n",
        },
    )
    assert limits.available_memory(str(proc), str(root)) == GIB


def test_the_least_of_the_three_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda _: (10 * GIB, resource.RLIM_INFINITY))
    proc = fake_proc(
        tmp_path, available_kib=8 * 1024 * 1024, vmsize_kib=1024 * 1024, cgroup="0::/a\n"
    )
    root = cgroup_files(tmp_path / "cg", {"a/memory.max": f"{6 * GIB}", "a/memory.current": "0"})
    assert limits.available_memory(str(proc), str(root)) == 6 * GIB


def test_no_room_left_is_zero_not_negative(tmp_path: Path, no_rlimit: None) -> None:
    proc = fake_proc(tmp_path, available_kib=1024, cgroup="0::/a\n")
    root = cgroup_files(tmp_path / "cg", {"a/memory.max": "100", "a/memory.current": "200"})
    assert limits.available_memory(str(proc), str(root)) == 0


# --- a real run under an address-space limit ------------------------------------------------


def sparse_npy(path: Path, shape: tuple[int, ...]) -> Path:
    """A ``.npy`` of float32 zeros of ``shape``, written sparse (instant, no disk used)."""
    with path.open("wb") as fh:
        np.lib.format.write_array_header_1_0(
            fh, {"descr": "<f4", "fortran_order": False, "shape": shape}
        )
        fh.truncate(fh.tell() + 4 * int(np.prod(shape)))
    return path


@pytest.mark.e2e
def test_e2e_an_input_past_ulimit_v_is_refused_up_front(tmp_path: Path) -> None:
    """Under ``ulimit -v`` the refusal read only MemAvailable (tens of GiB here), so the
    allocation failed later (MemoryError). Now the address space left is counted: exit
    2, one line, saying how much is available, before anything is allocated."""
    sparse_npy(tmp_path / "q.npy", (1, 1, 3 * 2**20, 128))  # 1.5 GiB
    for name in "kv":
        np.save(tmp_path / f"{name}.npy", np.zeros((1, 1, 4, 128), np.float32))
    address_space = 1200 << 20  # starts Python and numpy, cannot hold Q
    exe = str(Path(sys.executable).parent / "sdpa")
    # A launcher sets the limit, then becomes sdpa (no preexec_fn: unsafe in a
    # multithreaded pytest): ulimit -v as a shell would set it.
    launcher = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_AS, ({address_space}, {address_space})); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    got = subprocess.run(
        [sys.executable, "-c", launcher, exe, "compute", "q.npy", "k.npy", "v.npy"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (got.returncode, got.stdout) == (2, ""), got.stderr
    assert got.stderr.count("\n") == 1, got.stderr
    prefix = "sdpa: error: q.npy: needs 1.5 GiB of memory to be read, but "
    assert got.stderr.startswith(prefix), got.stderr
    left = float(got.stderr[len(prefix) :].split()[0])
    assert left < 1.2  # the address space left, not MemAvailable
