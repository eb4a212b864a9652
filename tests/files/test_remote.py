"""Inputs named by URL: read through the same readers and checks as local files (a
remote .npy refused exactly as a local one, the URL named), the size limit checked
before a byte is copied, and fsspec's and its backends' errors as one line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from sdpa_cli.errors import InputError
from sdpa_cli.files import remote
from sdpa_cli.files.loaders import load_array
from sdpa_cli.files.remote import MISSING_FSSPEC, is_url

fsspec = pytest.importorskip("fsspec")


def refused(source: str) -> str:
    with pytest.raises(InputError) as info:
        load_array(source)
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("s3://bucket/q.npy", True),
        ("file:///data/q.npy", True),
        ("memory://q.npy", True),
        ("gcs+x.y://b/q.npy", True),
        ("q.npy", False),
        ("/data/q.npy", False),
        ("C:\\data\\q.npy", False),
        ("x.npz:q", False),
        ("://q.npy", False),
    ],
)
def test_is_url(text: str, url: bool) -> None:
    assert is_url(text) is url


def test_a_url_array_is_read_into_memory(tmp_path: Path) -> None:
    arr = np.arange(12.0).reshape(3, 4)
    np.save(tmp_path / "a.npy", arr)
    got = load_array((tmp_path / "a.npy").as_uri())
    np.testing.assert_array_equal(got, arr)
    assert not isinstance(got, np.memmap)  # its temporary file is gone


def test_any_fsspec_protocol_and_members(tmp_path: Path) -> None:
    np.savez(tmp_path / "x.npz", q=np.ones((2, 3)), k=np.zeros(4))
    mem = fsspec.filesystem("memory")
    mem.pipe("/sdpa-test/x.npz", (tmp_path / "x.npz").read_bytes())
    mem.pipe("/sdpa-test/t.json", b"[[1, 2], [3, 4]]")
    try:
        np.testing.assert_array_equal(load_array("memory://sdpa-test/x.npz:q"), np.ones((2, 3)))
        np.testing.assert_array_equal(load_array("memory://sdpa-test/t.json"), [[1, 2], [3, 4]])
        assert refused("memory://sdpa-test/x.npz") == (
            "memory://sdpa-test/x.npz: holds 2 arrays; pick one with "
            "memory://sdpa-test/x.npz:NAME (names: k, q)"
        )
    finally:
        mem.rm("/sdpa-test", recursive=True)


def test_a_remote_npy_is_checked_as_a_local_one(tmp_path: Path) -> None:
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    good = tmp_path / "good.npy"
    np.save(good, np.ones((4, 4)))
    (tmp_path / "cut.npy").write_bytes(good.read_bytes()[:-8])
    (tmp_path / "fake.npy").write_bytes(b"not numpy at all")
    for name in ("obj.npy", "cut.npy", "fake.npy"):
        local = refused(str(tmp_path / name))
        url = (tmp_path / name).as_uri()
        assert refused(url) == local.replace(str(tmp_path / name), url)
    assert refused((tmp_path / "obj.npy").as_uri()).endswith(
        "holds Python objects (a pickle); sdpa never unpickles"
    )


def test_a_missing_url_or_a_folder(tmp_path: Path) -> None:
    url = (tmp_path / "gone.npy").as_uri()
    assert refused(url) == f"{url}: no such file"
    assert refused(tmp_path.as_uri()) == f"{tmp_path.as_uri()}: is a directory, not a tensor file"


def test_the_size_is_checked_before_copying(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.save(tmp_path / "a.npy", np.ones(100))
    size = (tmp_path / "a.npy").stat().st_size
    monkeypatch.setattr(remote, "size_limit", lambda: 100)
    url = (tmp_path / "a.npy").as_uri()
    assert refused(url).startswith(f"{url}: is {size} bytes (0.0 GiB) but 0.0 GiB can be read here")


def test_the_copy_stops_at_the_limit_whatever_the_size_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    np.save(tmp_path / "a.npy", np.ones(100))
    monkeypatch.setattr(remote, "size_limit", lambda: 100)
    monkeypatch.setattr(remote, "COPY_CHUNK", 64)
    real_info = fsspec.implementations.local.LocalFileSystem.info

    def no_size(self: object, path: str, **kwargs: object) -> dict[str, object]:
        return {**real_info(self, path, **kwargs), "size": None}  # as a server may

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "info", no_size)
    url = (tmp_path / "a.npy").as_uri()
    assert refused(url).startswith(f"{url}: is 128 bytes")


def test_an_unknown_protocol_is_one_line() -> None:
    message = refused("nosuch://bucket/q.npy")
    assert message.startswith("nosuch://bucket/q.npy: cannot be read: ValueError: ")
    assert "\n" not in message


def test_without_fsspec_a_url_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)
    assert refused("s3://bucket/q.npy") == f"s3://bucket/q.npy: {MISSING_FSSPEC}"
    assert MISSING_FSSPEC == "reading a URL needs fsspec: pip install fsspec"
