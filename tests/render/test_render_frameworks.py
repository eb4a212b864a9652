"""``compute --frameworks``' tables, read as text at 80 columns with no color."""

from __future__ import annotations

from io import StringIO

import numpy as np
from attention_cases import random_qkv
from rich.console import Console

from sdpa_cli.diagnosis.frameworks import compare_frameworks
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.render.frameworks import render_frameworks, rows_label


def _text(spec: AttentionSpec, width: int = 80) -> str:
    console = Console(file=StringIO(), width=width, color_system=None, force_terminal=False)
    console.print(render_frameworks(spec, compare_frameworks(spec), width))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return "\n".join(line.rstrip() for line in out.splitlines())


def _spec(L: int, S: int, **raw: str | bool) -> AttentionSpec:
    q, k, v = random_qkv(5, 2, 1, L, S, 4, 2)
    return build_spec(q, k, v, options=parse_options(raw))


def test_disagreements_are_tabled_by_kind_within_80_columns() -> None:
    text = _text(_spec(3, 5, causal=True, window="2,0"))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    [torch_line] = [line for line in lines if line.startswith("torch ")]
    assert torch_line.split() == [
        "torch",
        "upper-left",
        "2",
        "left,",
        "0",
        "right",
        "zeros",
        "—",
        "—",
    ]
    [hf_line] = [line for line in lines if line.startswith("hf ")]
    assert hf_line.split()[2:6] == ["1", "left,", "0", "right"]  # 2 counting the query
    assert "--window 2,0 as typed, read in each framework's terms (hf's counts the" in text
    assert "Causal alignment when L ≠ S: 6 of 6 rows differ" in text
    assert "\n  lower-right   flash, onnx, hf\n" in text
    assert "Window counting:" in text
    assert "query rows: batch 0 · head 0: 0–2; batch 1 · head 0: 0–2" in text
    assert lines[-1] == (
        "the five disagree on 6 of 6 rows: causal alignment when L ≠ S, window counting"
    )


def test_agreement_is_one_line() -> None:
    text = _text(_spec(4, 4, causal=True))
    assert text.splitlines()[-1] == "all five agree"
    assert "differ" not in text


def test_rows_label_joins_runs_and_counts_the_slices_left_out() -> None:
    spec = _spec(4, 4)
    assert rows_label(spec, [(0, 0, 0), (0, 0, 1), (0, 0, 3), (1, 0, 2)]) == (
        "batch 0 · head 0: 0–1, 3; batch 1 · head 0: 2"
    )
    scattered = [(0, 0, i) for i in range(0, 40, 2)]
    assert rows_label(spec, scattered) == (
        "batch 0 · head 0: 0, 2, 4, 6, 8, 10, 12, 14, and 12 more rows"
    )
    many = [(b, 0, 0) for b in range(8)]
    q, k, v = (np.zeros((8, 1, 1, 2)),) * 3
    wide = build_spec(q, k, v)
    assert rows_label(wide, many).endswith("; and 2 more slices")
