"""``sdpa inspect`` rendered as golden text, through the command line, at fixed widths
with color off, on the bundled samples.

Regenerate with ``make golden`` (or ``SDPA_REGEN_GOLDEN=1 python -m pytest -q
tests/render/test_render_inspect.py``) and review the diff: a change in a golden file is a
change in what users read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from clirunner import invoke
from golden_files import check_golden

from sdpa_cli.errors import ExitCode

ROOT = Path(__file__).resolve().parents[2]

EXPORTS = ("samples/check/out_scale_bug.npy", "samples/check/lse.npy")

# golden file: (arguments after `sdpa inspect`, width, exit code, stderr)
CASES: dict[str, tuple[tuple[str, ...], int, int, str]] = {
    # The README's example: every member of an .npz.
    "inspect_cross_npz_80.txt": (("samples/cross.npz",), 80, ExitCode.OK, ""),
    # A case file whose tensors live in an .npz: where each was read from.
    "inspect_cross_case_file_80.txt": (("samples/cross.yaml",), 80, ExitCode.OK, ""),
    # NaN counts, then a member that does not exist: what could be read is still shown.
    "inspect_padded_nan_refused_80.txt": (
        ("samples/padded_nan.yaml", "samples/cross.npz:w"),
        80,
        ExitCode.BAD_INPUT,
        "sdpa: error: samples/cross.npz:w: has no array 'w' (names: k, q, v)\n",
    ),
    # Two float16 files, one with a subnormal value: neither in the table nor noted
    # (1 of 16 384 values is no notable share; the JSON counts it).
    "inspect_long_q_k_80.txt": (
        ("samples/long_q.npy", "samples/long_k.npy"),
        80,
        ExitCode.OK,
        "",
    ),
    # A long tensor name: the table folds at 80 columns ...
    "inspect_check_exports_80.txt": (EXPORTS, 80, ExitCode.OK, ""),
    # ... and fits whole at 100.
    "inspect_check_exports_100.txt": (EXPORTS, 100, ExitCode.OK, ""),
}


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run from the repository root, so that paths print as typed (relative)."""
    monkeypatch.chdir(ROOT)


def render(args: tuple[str, ...], width: int, code: int, stderr: str) -> str:
    """``sdpa inspect ARGS`` at ``width`` columns with color off: stdout, trailing spaces
    cut; the exit code and stderr as given."""
    result = invoke("inspect", *args, env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert result.stderr == stderr
    return "\n".join(line.rstrip() for line in result.stdout.splitlines()) + "\n"


@pytest.mark.parametrize("golden", sorted(CASES))
def test_inspect_renders_as_the_golden_text(golden: str) -> None:
    args, width, code, stderr = CASES[golden]
    text = render(args, width, code, stderr)
    assert max(len(line) for line in text.splitlines()) <= width
    assert str(ROOT) not in text
    check_golden(golden, text)


def test_the_goldens_show_the_counts() -> None:
    """What the goldens must show, so that a regeneration cannot quietly bless a wrong one."""
    text = render(*CASES["inspect_padded_nan_refused_80.txt"])
    rows = {line.split()[0]: line.split() for line in text.splitlines()[3:6]}
    assert [rows[n][-2:] for n in "qkv"] == [["0", "0"], ["2", "0"], ["2", "0"]]
    text = render(*CASES["inspect_long_q_k_80.txt"])
    assert "subnormal" not in text  # one subnormal in 16 384 values is no damage
    assert "long_k:" not in text
    text = render(*CASES["inspect_cross_case_file_80.txt"])
    assert "q: read from samples/cross.npz:q" in text


def test_only_a_notable_share_of_subnormals_gets_a_note(tmp_path: Path) -> None:
    # Regression: randn in float16 got "4 values are subnormal in float16" as a note.
    rng = np.random.default_rng(0)
    randn = rng.standard_normal((2, 8, 128, 64))
    np.save(tmp_path / "randn.npy", randn.astype(np.float16))
    np.save(tmp_path / "small.npy", (randn * 0.002).astype(np.float16))
    paths = (str(tmp_path / "randn.npy"), str(tmp_path / "small.npy"))
    text = render(paths, 80, ExitCode.OK, "")
    randn_row = next(line for line in text.splitlines() if line.startswith("randn "))
    assert "subnormal" not in text.split(randn_row)[1].split("small ")[0]  # counted in JSON only
    assert "3157 subnormal" in text  # the notable share: in the table, and noted
    assert "randn:" not in text
    assert " ".join(text.split("\n\nsmall: ")[1].split()) == (
        "3157 values (2.41% of the nonzero ones) are subnormal in float16 (below its "
        "smallest normal 6.1e-5: fewer significant bits)"
    )
