"""Tests of sdpa_cli.errors: the one-line message, a long file name shortened in it."""

from __future__ import annotations

import os
from pathlib import Path

from clirunner import assert_one_error_line, invoke

from sdpa_cli.errors import MAX_WHERE, InputError, shortened


def test_a_long_path_is_cut_in_the_middle() -> None:
    where = "/data/" + "x" * 6000 + "/q.npy"
    short = shortened(where)
    assert len(short) == MAX_WHERE
    assert short.startswith("/data/xxx")
    assert short.endswith("xxx/q.npy")
    assert short.count("…") == 1
    assert str(InputError(where, "no such file")) == f"{short}: no such file"


def test_a_path_up_to_the_limit_is_whole() -> None:
    where = "d/" * 99 + "qq"
    assert len(where) == MAX_WHERE
    assert shortened(where) == where


def test_a_6000_character_path_is_not_echoed_whole(tmp_path: Path) -> None:
    line = assert_one_error_line(invoke("compute", "a" * 6000 + ".yaml"))
    assert len(line) < 300
    assert line.endswith("aaa.yaml: cannot be read: File name too long")
    assert "…" in line


def test_a_non_utf8_file_name_reads_as_the_shell_shows_it(tmp_path: Path) -> None:
    name = os.fsdecode(b"q\xff.npy")
    (tmp_path / name).write_bytes(b"not numpy")
    line = assert_one_error_line(invoke("inspect", str(tmp_path / name)))
    assert line == (
        f"sdpa: error: {tmp_path}/q\\xff.npy: is not a .npy file (it does not start with "
        "the NUMPY magic bytes)"
    )
