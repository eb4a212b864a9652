"""``sdpa grad`` rendered as golden text, through the command line, at fixed widths with
color off, on the bundled samples.

Regenerate with ``make golden`` (or ``SDPA_REGEN_GOLDEN=1 python -m pytest -q
tests/render/test_render_grad.py``) and review the diff: a change in a golden file is a change
in what users read.

The numeric check's relative errors are rounding noise (1e-16 … 1e-9) that differs from
one numpy or BLAS build to another, so its golden masks them (``#.##e-##``, the same
width) and samples one entry per gradient (``--samples 1``): with more, which entry is
the worst, and so the place and values shown, is noise too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from clirunner import invoke
from golden_files import check_golden

from sdpa_cli.errors import ExitCode
from sdpa_cli.render.grad import GAIN_NOTE

ROOT = Path(__file__).resolve().parents[2]

BATCHED = ("samples/batched_q.npy", "samples/batched_k.npy", "samples/batched_v.npy")

# golden file: (arguments after `sdpa grad`, width)
CASES: dict[str, tuple[tuple[str, ...], int]] = {
    # A one-hot row whose gradient vanishes, dO = ones.
    "grad_vanishing_80.txt": (("samples/vanishing.yaml",), 80),
    # The README's example: the same with a standard normal dO.
    "grad_vanishing_dout_random_80.txt": (("samples/vanishing.yaml", "--dout", "random"), 80),
    # Causal, with the numeric check's table (its errors masked) and no findings.
    "grad_causal_numeric_80.txt": (
        ("samples/causal.yaml", "--check-numeric", "--samples", "1"),
        80,
    ),
    # Judged against float16: gradients that flush to zero, keys without gradient.
    "grad_fp16_overflow_dtype_80.txt": (("samples/fp16_overflow.yaml", "--dtype", "float16"), 80),
    # Grouped-query heads: one slice, dK and dV summed over query heads, per-head tables.
    "grad_batched_gqa_100.txt": ((*BATCHED, "--causal", "--batch", "1", "--head", "2"), 100),
}

NOISE = re.compile(r"\d\.\d\de[+-]\d\d")


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root, so that paths print as typed (relative)."""
    monkeypatch.chdir(ROOT)


def mask_numeric_errors(text: str) -> str:
    """The numeric check table with its relative errors replaced by ``#.##e-##``."""
    if "\nnumeric check  " not in text:
        return text
    head, table = text.split("\nnumeric check  ", 1)
    table, tail = table.split("\n\n", 1)
    rows = []
    for line in table.splitlines():
        if line.split()[:1] in (["dQ"], ["dK"], ["dV"], ["dbias"]):
            line = NOISE.sub("#.##e-##", line, count=1)
        rows.append(line)
    return head + "\nnumeric check  " + "\n".join(rows) + "\n\n" + tail


def render(args: tuple[str, ...], width: int) -> str:
    """``sdpa grad ARGS`` at ``width`` columns with color off: stdout, trailing spaces cut."""
    result = invoke("grad", *args, env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code == ExitCode.OK, (result.exit_code, result.stdout, result.stderr)
    assert result.stderr == ""
    return "\n".join(line.rstrip() for line in result.stdout.splitlines()) + "\n"


@pytest.mark.parametrize("golden", sorted(CASES))
def test_grad_renders_as_the_golden_text(golden: str) -> None:
    args, width = CASES[golden]
    text = render(args, width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert str(ROOT) not in text
    check_golden(golden, mask_numeric_errors(text))


def test_the_numeric_check_golden_masks_only_the_errors() -> None:
    text = render(*CASES["grad_causal_numeric_80.txt"])
    masked = mask_numeric_errors(text)
    table = masked.split("\nnumeric check  ")[1].split("\n\n")[0].splitlines()
    rows = [line for line in table if line.split()[:1] in (["dQ"], ["dK"], ["dV"])]
    assert len(rows) == 3
    for line in rows:
        assert "#.##e-##" in line
        assert line.split()[-1] == "ok"
    # Everything outside the numeric check's rows is untouched.
    changed = [a for a, b in zip(text.splitlines(), masked.splitlines(), strict=True) if a != b]
    assert [line.split()[0] for line in changed] == ["dQ", "dK", "dV"]


def test_the_goldens_show_the_vanishing_row() -> None:
    """What the goldens must show, so that a regeneration cannot quietly bless a wrong one."""
    text = render(*CASES["grad_vanishing_80.txt"])
    q1 = next(line for line in text.splitlines() if line.startswith("q1 "))
    assert q1.split()[-2:] == ["1.78e-07", "vanishing"]
    assert "dO all ones · loss ℓ = Σ O ⊙ dO · backward in float64" in text
    text = render(*CASES["grad_vanishing_dout_random_80.txt"])
    assert "dO standard normal, seed 0" in text
    text = render(*CASES["grad_fp16_overflow_dtype_80.txt"])
    assert "gradient range float16" in text
    text = render(*CASES["grad_batched_gqa_100.txt"])
    assert "── batch 1 · head 2 (kv head 1) ─" in text
    assert "summed over query heads 2–3" in text


def test_the_dq_table_says_its_rows_were_cut_as_the_dk_table_does() -> None:
    # Regression: the dQ table got the rows already cut to --max-rows, so it showed
    # neither the "…" row nor "rows 0–2 of 6"; the dK table below it showed both.
    text = render((*BATCHED, "--batch", "0", "--head", "0", "--max-rows", "3"), 80)
    dq = text.split("dQ  dS · K · scale\n")[1].split("\n\n")[0].splitlines()
    dk = text.split("dK  dSᵀ · Q · scale")[1].split("\n\n")[0].splitlines()
    assert dq[2:] == [
        "q0   0.0051   -0.0299   -0.0670   …    0.57",
        "q1   0.0128   -0.1348   -0.0952   …   0.749",
        "q2   0.1124    0.0576   -0.0829   …   0.815",
        "…         …         …         …   …       …",
        "rows 0–2 of 6, columns 0–2 of 8 shown",
        GAIN_NOTE,  # what the last column is, under it
    ]
    assert dk[-2:] == [
        "…          …         …         …   …",
        "rows 0–2 of 6, columns 0–2 of 8 shown",
    ]


def test_grad_rows_picks_the_rows_of_the_dq_table() -> None:
    text = render((*BATCHED, "--batch", "0", "--head", "0", "--rows", "2:6", "--max-rows", "2"), 80)
    dq = text.split("dQ  dS · K · scale\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in dq[2:-1]] == ["q2", "q3", "…", "rows"]
    assert dq[-2] == "rows 2–3 of 6, columns 0–1 of 8 shown"
