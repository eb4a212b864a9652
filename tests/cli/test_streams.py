"""Tests of the process's stream set-up: ASCII stand-ins, COLUMNS, the signal handlers
given back, the verdict kept through a broken pipe."""

from __future__ import annotations

import os
import signal

import pytest

from sdpa_cli.cli import streams


def test_ascii_stand_ins() -> None:
    text = "1/√d_k · Q·Kᵀ ≥ 0.99 … ─│┼ ★"
    assert text.encode("ascii", "sdpa-ascii") == b"1/sqrtd_k * Q*K^T >= 0.99 ... -|+ ?"


@pytest.mark.parametrize(
    ("given", "kept"), [("0", False), ("5", False), ("x", False), ("80", True)]
)
def test_columns_that_make_no_sense_are_unset(
    monkeypatch: pytest.MonkeyPatch, given: str, kept: bool
) -> None:
    monkeypatch.setenv("COLUMNS", given)
    try:
        streams.set_up()
    finally:
        streams.tear_down()
    assert (os.environ.get("COLUMNS") == given) is kept


def test_handlers_are_given_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    streams.set_up()
    try:
        assert signal.getsignal(signal.SIGTERM) is streams._terminate
    finally:
        streams.tear_down()
    assert signal.getsignal(signal.SIGTERM) is before


def test_verdict_is_reset_by_each_run() -> None:
    streams.set_up()
    streams.tear_down()
    assert streams.verdict() == 0
    assert streams.decided(1) == 1
    assert streams.verdict() == 1
    streams.set_up()
    streams.tear_down()
    assert streams.verdict() == 0
