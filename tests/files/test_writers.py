"""Tests of the atomic writers: what is at the path decides how it is written (a
symbolic link's target, a device or FIFO written through, a directory refused), and
staged writes wait for ``commit``."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pytest

from sdpa_cli.errors import InputError
from sdpa_cli.files import writers
from sdpa_cli.files.writers import immediate, staged, write_all_atomic, write_atomic


def writes(data: bytes) -> Callable[[BinaryIO], None]:
    def write(fh: BinaryIO) -> None:
        fh.write(data)

    return write


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_empty_name_is_named_as_empty(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="the file name is empty"):
        write_atomic("", writes(b"x"))


def test_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="is a directory"):
        write_atomic(tmp_path, writes(b"x"))


def test_symlink_output_writes_its_target_and_stays_a_link(tmp_path: Path) -> None:
    target = tmp_path / "real.bin"
    target.write_bytes(b"old")
    target.chmod(0o640)
    link = tmp_path / "link.bin"
    link.symlink_to("real.bin")
    write_atomic(link, writes(b"new"))
    assert link.is_symlink()
    assert os.readlink(link) == "real.bin"
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert leftovers(tmp_path) == []


def test_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "link.bin"
    link.symlink_to("made.bin")
    write_atomic(link, writes(b"new"))
    assert link.is_symlink()
    assert (tmp_path / "made.bin").read_bytes() == b"new"


@pytest.mark.skipif(not os.path.exists(os.devnull), reason="needs /dev/null")
def test_dev_null_stays_a_device() -> None:
    """As root, the rename used to replace /dev/null with a regular file."""
    write_atomic(os.devnull, writes(b"x" * 100))
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    assert leftovers(Path(os.devnull).parent) == []


def read_while_written(fifo: Path, write: Callable[[BinaryIO], None]) -> bytes:
    """Make ``fifo`` and read it whole on a thread while ``write_atomic`` writes into it."""
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    write_atomic(fifo, write)
    reader.join(timeout=10)
    assert len(got) == 1, "the reader got nothing"
    return got[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_written_through(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    assert read_while_written(fifo, writes(b"through the pipe")) == b"through the pipe"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert leftovers(tmp_path) == []


def writes_npz(fh: BinaryIO) -> None:
    """A writer that seeks: a zip goes back to its headers, as np.savez does."""
    np.savez(fh, a=np.arange(6.0), b=np.eye(2))


def assert_npz(data: bytes) -> None:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        assert npz.files == ["a", "b"]
        assert npz["a"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert npz["b"].tolist() == [[1.0, 0.0], [0.0, 1.0]]


@pytest.mark.skipif(not os.path.exists(os.devnull), reason="needs /dev/null")
def test_seeking_writer_into_dev_null() -> None:
    """An .npz into /dev/null used to fail: a zip cannot seek in a device."""
    write_all_atomic([(os.devnull, writes_npz)])
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_seeking_writer_into_a_fifo_sends_a_whole_npz(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    assert_npz(read_while_written(fifo, writes_npz))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_without_a_reader_is_refused_after_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open for writing would wait forever for a reader; it gives up instead."""
    monkeypatch.setattr(writers, "FIFO_WAIT", 1)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(InputError) as caught:
        write_atomic(fifo, writes(b"never read"))
    assert 1 <= time.monotonic() - start < 5
    assert caught.value.where == str(fifo)
    assert caught.value.problem == (
        "is a FIFO that no process reads within 1 s; start its reader first"
    )
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert leftovers(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_whose_reader_comes_late_within_the_wait(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def late_reader() -> None:
        time.sleep(0.5)
        got.append(fifo.read_bytes())

    reader = threading.Thread(target=late_reader)
    reader.start()
    write_atomic(fifo, writes(b"x" * 300_000))  # more than a pipe holds: blocking writes
    reader.join(timeout=10)
    assert got == [b"x" * 300_000]


@pytest.mark.skipif(sys.platform == "win32", reason="needs Unix sockets")
def test_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        with pytest.raises(InputError, match="not a regular file"):
            write_atomic(path, writes(b"x"))
    assert leftovers(tmp_path) == []


def test_staged_writes_appear_only_on_commit(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.xml"
    a.write_bytes(b"old")
    with staged() as stage:
        write_all_atomic([(a, writes(b"A")), (b, writes(b"B"))])
        assert a.read_bytes() == b"old"
        assert not b.exists()
        assert len(leftovers(tmp_path)) == 2
        stage.commit()
    assert (a.read_bytes(), b.read_bytes()) == (b"A", b"B")
    assert leftovers(tmp_path) == []


def test_staged_writes_are_removed_on_failure(tmp_path: Path) -> None:
    a = tmp_path / "a.json"
    a.write_bytes(b"old")

    def interrupted() -> None:
        with staged():
            write_atomic(a, writes(b"A"))
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert a.read_bytes() == b"old"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("in_stage", [False, True], ids=["alone", "staged"])
def test_ctrl_c_the_moment_the_temporary_appears_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_stage: bool
) -> None:
    """A watcher that interrupts as soon as it sees the temporary file (as a user's
    Ctrl-C may land) finds it removed: its name was recorded before it was made."""

    def made_then_interrupted(path: Path) -> int:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        raise KeyboardInterrupt

    def save() -> None:
        with staged() if in_stage else contextlib.nullcontext():
            write_atomic(tmp_path / "out.npz", writes(b"A"))

    monkeypatch.setattr(writers, "create_new", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        save()
    assert list(tmp_path.iterdir()) == []


def test_a_temporary_name_taken_by_another_file_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = tmp_path / ".out.npz.taken.tmp"
    theirs.write_bytes(b"theirs")
    monkeypatch.setattr(writers, "temporary_beside", lambda target: theirs)
    with pytest.raises(InputError, match=r"out\.npz: cannot be written: File exists"):
        write_atomic(tmp_path / "out.npz", writes(b"A"))
    assert theirs.read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name]


def test_immediate_writes_inside_a_stage(tmp_path: Path) -> None:
    a = tmp_path / "a.bin"
    with staged(), immediate():
        write_atomic(a, writes(b"now"))
        assert a.read_bytes() == b"now"


def test_failed_writer_leaves_nothing(tmp_path: Path) -> None:
    def fail(fh: BinaryIO) -> None:
        fh.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(InputError, match="No space left on device"):
        write_all_atomic([(tmp_path / "a", writes(b"A")), (tmp_path / "b", fail)])
    assert sorted(p.name for p in tmp_path.iterdir()) == []
