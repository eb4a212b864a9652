"""Tests of sdpa_cli.files.opening: inputs that are not regular files (FIFOs, devices,
directories, sockets, standard input) and files that change while being read."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from clirunner import CLEAN_ENV, assert_one_error_line, invoke

from sdpa_cli.cli import cli
from sdpa_cli.errors import InputError
from sdpa_cli.files import limits, npy, opening
from sdpa_cli.files.checks import check_dtype
from sdpa_cli.files.loaders import load_array
from sdpa_cli.files.structured import TEXT_CAPS

QKV = np.arange(2 * 3 * 4, dtype=np.float32).reshape(1, 2, 3, 4) / 10
CASE = {"q": [[1.0, 0.0], [2.0, 0.0]], "k": [[1.0, 0.0], [0.0, 1.0]], "v": [[1.0, 2.0], [3.0, 4.0]]}


@pytest.fixture(autouse=True)
def _forget_streams() -> Iterator[None]:
    """Each test reads its FIFOs afresh (a run remembers the streams it read)."""
    opening._streams.clear()
    yield
    opening._streams.clear()


def error(source: str | Path) -> str:
    with pytest.raises(InputError) as info:
        load_array(str(source))
    return str(info.value)


def npy_bytes(arr: np.ndarray[Any, Any]) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def feed_fifo(path: Path, data: bytes) -> threading.Thread:
    """A writer that opens the FIFO at ``path`` and writes ``data``, in a thread."""

    def write() -> None:
        with path.open("wb") as fh:
            fh.write(data)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


# --- what is not a regular file ----------------------------------------------------------


@pytest.mark.parametrize(
    ("device", "kind"), [("/dev/zero", "character device"), ("/dev/null", "character device")]
)
def test_a_device_is_refused_not_read_without_bound(device: str, kind: str) -> None:
    assert error(device) == f"{device}: is a {kind}, not a regular file"


def test_dev_zero_named_json_is_refused(tmp_path: Path) -> None:
    """The 256 MiB text cap read the file's size, 0 for a device: /dev/zero ran out of memory."""
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    assert error(tmp_path / "zero.json").endswith(
        "zero.json: is a character device, not a regular file"
    )


def test_a_directory_is_refused(tmp_path: Path) -> None:
    assert error(tmp_path) == f"{tmp_path}: is a directory, not a regular file"


def test_a_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.npy"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        assert error(path) == f"{path}: is a socket, not a regular file"


# --- FIFOs: read once, within the caps ---------------------------------------------------


def test_a_fifo_without_a_writer_does_not_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opened O_NONBLOCK, then given FIFO_WAIT seconds for a writer, where open() blocked forever."""
    monkeypatch.setattr(opening, "FIFO_WAIT", 0)
    path = tmp_path / "q.npy"
    os.mkfifo(path)
    assert error(path) == (
        f"{path}: is a FIFO that no process wrote to within 0 s; start its writer first"
    )


def test_a_fifo_whose_writer_wrote_nothing_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "q.npy"
    os.mkfifo(path)
    feed_fifo(path, b"")
    assert error(path) == f"{path}: is empty (nothing was written to it)"


def test_a_fifo_is_read_once_and_sniffed_from_its_bytes(tmp_path: Path) -> None:
    """No extension: the format is sniffed from the bytes read, not from a second open."""
    path = tmp_path / "q"
    os.mkfifo(path)
    writer = feed_fifo(path, npy_bytes(QKV))
    got = load_array(str(path))
    writer.join(5)
    np.testing.assert_array_equal(got, QKV)
    # read again by name (as inspect sniffs, then reads): the same bytes, not a drained pipe
    np.testing.assert_array_equal(load_array(str(path)), QKV)


def test_a_fifo_of_json_text_is_read(tmp_path: Path) -> None:
    path = tmp_path / "q"
    os.mkfifo(path)
    writer = feed_fifo(path, b" [[1, 2], [3, 4.5]]")
    got = load_array(str(path))
    writer.join(5)
    np.testing.assert_array_equal(got, [[1, 2], [3, 4.5]])


def test_text_from_a_stream_stops_at_the_text_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    assert max(TEXT_CAPS.values()) == opening.STREAM_TEXT_CAP
    monkeypatch.setattr(opening, "STREAM_TEXT_CAP", 1 << 20)
    with pytest.raises(InputError) as info:
        opening._read_stream(io.BytesIO(b"[" + b"1, " * 400_000), "<stdin>")
    assert str(info.value).startswith("<stdin>: holds more than 1 MiB")


def test_a_binary_stream_is_read_up_to_the_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    data = npy_bytes(np.zeros(1000))
    monkeypatch.setattr(opening, "STREAM_TEXT_CAP", 100)
    assert opening._read_stream(io.BytesIO(data), "<stdin>") == data
    monkeypatch.setattr(limits, "available_memory", lambda: 5000)
    with pytest.raises(InputError, match="holds more than 0 MiB"):
        opening._read_stream(io.BytesIO(data), "<stdin>")


# --- standard input: -, one input per command ---------------------------------------------


def run(args: list[str], stdin: bytes) -> Any:
    runner = CliRunner(env=dict(CLEAN_ENV))
    return runner.invoke(cli, args, input=stdin, catch_exceptions=False)


def test_a_case_file_from_standard_input(tmp_path: Path) -> None:
    got = run(["compute", "-", "--format", "json"], json.dumps(CASE).encode())
    assert got.exit_code == 0, got.stderr
    out = json.loads(got.stdout)
    from_file = tmp_path / "case.json"
    from_file.write_text(json.dumps(CASE))
    expected = json.loads(invoke("compute", str(from_file), "--format", "json").stdout)
    assert out["stages"] == expected["stages"]


def test_a_yaml_case_file_from_standard_input_is_sniffed() -> None:
    text = "q: [[1.0, 0.0], [2.0, 0.0]]\nk: [[1.0, 0.0], [0.0, 1.0]]\nv: [[1.0, 2.0], [3.0, 4.0]]\n"
    assert run(["compute", "-", "--format", "json"], text.encode()).exit_code == 0


def test_a_tensor_from_standard_input(tmp_path: Path) -> None:
    for name in "kv":
        np.save(tmp_path / f"{name}.npy", QKV)
    got = run(["compute", "-", str(tmp_path / "k.npy"), str(tmp_path / "v.npy")], npy_bytes(QKV))
    assert got.exit_code == 0, got.stderr


def test_a_second_dash_is_a_usage_error(tmp_path: Path) -> None:
    np.save(tmp_path / "v.npy", QKV)
    got = run(["compute", "-", "-", str(tmp_path / "v.npy")], npy_bytes(QKV))
    line = assert_one_error_line(got)
    assert line == "sdpa: error: -: standard input already feeds q; only one input may be -"


def test_empty_standard_input() -> None:
    line = assert_one_error_line(run(["compute", "-"], b""))
    assert line == "sdpa: error: <stdin>: is empty (nothing was written to it)"


# --- a file that changes while it is read ------------------------------------------------


@pytest.mark.parametrize("shrink_to", [0, 200])
def test_a_npy_truncated_while_read_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shrink_to: int
) -> None:
    """Memory-mapped, a truncated file killed the process with SIGBUS; read in, it is
    one line naming the file, its size now and the size expected."""
    path = tmp_path / "q.npy"
    np.save(path, np.zeros(1000))
    size = path.stat().st_size

    def truncate_after_header(dtype: Any, label: str) -> None:
        check_dtype(dtype, label)
        os.truncate(path, shrink_to)  # another process, between the header and the data

    monkeypatch.setattr(npy, "check_dtype", truncate_after_header)
    assert error(path) == (
        f"{path}: changed while being read (now {shrink_to} bytes, expected {size})"
    )


def test_a_safetensors_truncated_while_read_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = pytest.importorskip("safetensors.numpy")
    from sdpa_cli.files import safetensors

    path = tmp_path / "t.safetensors"
    st.save_file({"t": np.ones(100_000, np.float32)}, str(path))  # past the read buffer
    size = path.stat().st_size
    shape_of = safetensors._entry_dtype_and_shape

    def truncate_after_header(entry: Any, label: str) -> Any:
        os.truncate(path, 100)
        return shape_of(entry, label)

    monkeypatch.setattr(safetensors, "_entry_dtype_and_shape", truncate_after_header)
    assert error(path) == f"{path}: changed while being read (now 100 bytes, expected {size})"


def test_an_input_too_large_for_memory_is_refused_before_allocating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.save(tmp_path / "q.npy", np.zeros(1000))
    monkeypatch.setattr(limits, "available_memory", lambda: 4000)
    monkeypatch.setattr(np, "empty", lambda *a, **k: pytest.fail("allocated"))
    assert error(tmp_path / "q.npy") == (
        f"{tmp_path / 'q.npy'}: needs 0.0 GiB of memory to be read, but 0.0 GiB is available"
    )


def test_fortran_order_npy_reads_the_same_values(tmp_path: Path) -> None:
    arr = np.asfortranarray(np.arange(24, dtype=np.float64).reshape(2, 3, 4))
    np.save(tmp_path / "f.npy", arr)
    got = load_array(str(tmp_path / "f.npy"))
    np.testing.assert_array_equal(got, arr)
    assert got.shape == (2, 3, 4)


# --- end to end: the installed sdpa, as a shell user runs it -------------------------------


def sdpa(*args: str, cwd: Path, stdin: Any = None, timeout: float = 60) -> Any:
    exe = Path(sys.executable).parent / "sdpa"
    return subprocess.run(
        [str(exe), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        stdin=stdin if stdin is not None else subprocess.DEVNULL,
        timeout=timeout,
        env={**{k: v for k, v in os.environ.items() if k not in CLEAN_ENV}, "COLUMNS": "100"},
    )


@pytest.mark.e2e
@pytest.mark.parametrize("command", ["compute", "inspect"])
def test_e2e_a_fifo_with_no_writer_ends_at_once(tmp_path: Path, command: str) -> None:
    """``mkfifo f; sdpa compute f k v`` hung forever."""
    os.mkfifo(tmp_path / "f")
    for name in "kv":
        np.save(tmp_path / f"{name}.npy", QKV)
    args = ["f", "k.npy", "v.npy"] if command == "compute" else ["f"]
    got = sdpa(command, *args, cwd=tmp_path, timeout=30)
    assert (got.returncode, got.stdout) == (2, "")
    assert got.stderr == (
        "sdpa: error: f: is a FIFO that no process wrote to within 3 s; start its writer first\n"
    )


@pytest.mark.e2e
def test_e2e_a_case_file_piped_to_dash(tmp_path: Path) -> None:
    (tmp_path / "case.json").write_text(json.dumps(CASE))
    with (tmp_path / "case.json").open("rb") as fh:
        piped = subprocess.Popen(["cat"], stdin=fh, stdout=subprocess.PIPE)
        got = sdpa("compute", "-", "--format", "json", cwd=tmp_path, stdin=piped.stdout)
        piped.wait()
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["stages"]


@pytest.mark.parametrize(
    "args",
    [
        ["compute", "f.yaml"],
        ["check", "f.yaml"],
        ["inspect", "f.npy"],
        ["report", "merge", "f.json"],
        ["check", "--manifest", "f.yaml"],
    ],
)
def test_every_command_refuses_a_fifo_with_no_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str]
) -> None:
    """Each hung forever on a FIFO given as its case file, tensor, report or manifest."""
    monkeypatch.setattr(opening, "FIFO_WAIT", 0)
    monkeypatch.chdir(tmp_path)
    os.mkfifo(args[-1])
    line = assert_one_error_line(invoke(*args))
    assert line == (
        f"sdpa: error: {args[-1]}: is a FIFO that no process wrote to within 0 s; "
        "start its writer first"
    )


def test_a_config_file_that_is_a_fifo_with_no_writer_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(opening, "FIFO_WAIT", 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "case.json").write_text(json.dumps(CASE))
    os.mkfifo("sdpa.yaml")
    line = assert_one_error_line(invoke("compute", "case.json"))
    assert line.startswith("sdpa: error: sdpa.yaml: is a FIFO that no process wrote to")
