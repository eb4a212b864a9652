"""``sdpa diff``'s view at 80 columns without color: the runs, the pairing (the calls
only in one run named), the rule, a row per pair whose last column says where it
diverges, and the conclusion; golden files of the samples and of every kind of row."""

from __future__ import annotations

import dataclasses
import io

from golden_files import check_golden
from rich.console import Console

from sdpa_cli.api.diff import diff_runs
from sdpa_cli.check.diff import BOUND, CallDiff, Difference, Kernel, RunDiff
from sdpa_cli.check.pairing import Pairing
from sdpa_cli.engine import precision
from sdpa_cli.files.samples import samples_dir
from sdpa_cli.render.diff import power_of_two, render_diff

U = precision.fmt("bfloat16").unit_roundoff


def shown(diff: RunDiff, width: int = 80) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None, no_color=True)
    console.print(render_diff(diff, width))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"


def sample(run: str) -> RunDiff:
    folder = samples_dir() / "diff"
    found = diff_runs(str(folder / "float32.yaml"), str(folder / f"{run}.yaml"))
    return dataclasses.replace(found, a="float32.yaml", b=f"{run}.yaml")


def test_the_samples_read_as_their_golden_files() -> None:
    for run in ("bfloat16", "rotary_bug", "kernel_bug"):
        check_golden(f"diff_{run}_80.txt", shown(sample(run)))


def differences(*units: float) -> dict[str, Difference]:
    return {n: Difference(x * U, (0, 1), U) for n, x in zip("qkv", units, strict=False)}


def test_every_kind_of_row_reads_as_its_golden_file() -> None:
    limit = BOUND * U
    calls = (
        CallDiff(
            "layers.0.attn",
            "blocks.0",
            "bfloat16",
            differences(1, 1.2, 0.9),
            24,
            0,
            limit=limit,
            kernel=Kernel("b", True),
        ),
        CallDiff(
            "layers.1.attn",
            "blocks.1",
            "bfloat16",
            differences(2, 2, 2),
            24,
            6,
            limit=limit,
            kernel=Kernel("b", True),
        ),
        CallDiff(
            "layers.2.attn",
            "blocks.2",
            "bfloat16",
            mismatch="the scale differs: 0.25 in A, 0.0625 in B",
            limit=limit,
        ),
        CallDiff(
            "layers.3.attn",
            "blocks.3",
            "bfloat16",
            differences(3, 3, 3),
            24,
            0,
            limit=limit,
            kernel=Kernel("b", True),
            kernel_a=Kernel("a", False, "output.close", "all of it"),
        ),
        CallDiff("layers.4.attn", "blocks.4", error="blocks.safetensors: cannot be read"),
    )
    pairing = Pairing(tuple((i, i) for i in range(5)), "layer", ("layers.5.attn",), ())
    check_golden("diff_rows_80.txt", shown(RunDiff("a.yaml", "b.yaml", pairing, calls)))


def test_a_unit_roundoff_reads_as_a_power_of_two() -> None:
    assert power_of_two(2.0**-8) == "2^-8"
    assert power_of_two(2.0**-24) == "2^-24"
    assert power_of_two(0.003) == "0.003"
