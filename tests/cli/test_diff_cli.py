"""sdpa diff on the samples (samples/diff: one toy model run in float32, in bfloat16,
with a rotary bug and with a kernel bug): exit codes, the table, the JSON (validated
against its schema by the runner), and bad input as one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from clirunner import ANSI, assert_one_error_line, invoke, strict_json

from sdpa_cli.check.diff import BOUND, JUMP
from sdpa_cli.errors import ExitCode
from sdpa_cli.files.loaders import load_array
from sdpa_cli.files.samples import samples_dir
from sdpa_cli.text import compact

SAMPLES = samples_dir() / "diff"
A = "sample:diff/float32"
U = 2.0**-8  # bfloat16's unit roundoff, the narrower run's


def units(run: str, layer: int, name: str) -> float:
    """How far run's ``name`` at ``layer`` is from float32's, worked out here with numpy
    from the samples' files: the largest RMS(B − A) / RMS(A) of a (batch, head) slice,
    in units of bfloat16's unit roundoff (every row sees a key: the runs are causal)."""
    a, b = (
        load_array(f"{SAMPLES / r}.safetensors:model.layers.{layer}.{name}", name=name)
        for r in ("float32", run)
    )
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ratio = np.sqrt(np.square(b - a).sum(axis=(-2, -1)) / np.square(a).sum(axis=(-2, -1)))
    return float(ratio.max()) / U


def test_bfloat16_against_float32_names_no_divergence() -> None:
    result = invoke("diff", A, "sample:diff/bfloat16", env={"COLUMNS": "80"})
    assert result.exit_code == ExitCode.OK, result.output
    assert ANSI not in result.stdout
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "3 calls paired by name" in lines
    largest = max(units("bfloat16", layer, n) for layer in range(3) for n in "qkv")
    assert largest < BOUND
    assert lines[-2:] == [
        f"no divergence: 3 of 3 calls compared, Q, K and V within {compact(largest, 2)}u of "
        "A's; 3 of B's",
        "outputs pass against their own inputs",
    ]


def test_a_rotary_bug_is_upstream_of_attention_in_its_layer() -> None:
    result = invoke("diff", A, "sample:diff/rotary_bug", env={"COLUMNS": "80"})
    assert result.exit_code == ExitCode.CHECK_FAILED, result.output
    rows = [line.split() for line in result.stdout.splitlines()]
    one, two = (
        [units("rotary_bug", layer, n) for n in ("q", "k", "v", "output")] for layer in (1, 2)
    )
    assert one[0] > BOUND  # Q and K turned by the rotary bug, V not
    assert one[1] > BOUND
    assert one[2] < BOUND
    shown = [compact(x, 3) for x in one]
    assert ["1", *shown, "pass", "upstream:", "Q", "K"] in rows
    # layer 2 inherits the bug: past 64u, yet under 4× layer 1's, so no new divergence
    assert BOUND < max(two[:3]) < JUMP * max(one[:3])
    assert ["2", *(compact(x, 3) for x in two), "pass"] in rows
    assert result.stdout.rstrip().endswith(
        "first divergence: model.layers.1.self_attn — upstream of attention (Q, K differ\n"
        f"by {shown[0]}u, {shown[1]}u; V agrees)"
    )


def test_a_kernel_bug_is_in_the_kernel_and_in_json() -> None:
    result = invoke("diff", A, "sample:diff/kernel_bug", "--format", "json")
    assert result.exit_code == ExitCode.CHECK_FAILED, result.output
    document = strict_json(result.stdout)
    assert document["first"] == {
        "a": "model.layers.1.self_attn",
        "b": "model.layers.1.self_attn",
        "where": "kernel",
    }
    assert document["exit_code"] == 1
    layer = document["calls"][1]
    assert layer["kernel"]["passed"] is False
    assert layer["kernel"]["check"] == "output.close"
    assert layer["differ"] == []
    assert layer["format"] == "bfloat16"
    assert layer["unit"] == 2.0**-8
    assert document["rule"] == {"bound": 64.0, "jump": 4.0}


def test_the_bound_is_a_flag() -> None:
    """A bound under the rounding of bfloat16 makes every input differ."""
    result = invoke("diff", A, "sample:diff/bfloat16", "--bound", "0.5", "--format", "json")
    assert result.exit_code == ExitCode.CHECK_FAILED
    assert json.loads(result.stdout)["calls"][0]["differ"] == ["q", "k", "v"]


def test_a_capture_s_folder_is_read_as_its_manifest(tmp_path: Path) -> None:
    for run in ("float32", "bfloat16"):
        folder = tmp_path / run
        folder.mkdir()
        shutil.copy(SAMPLES / f"{run}.safetensors", folder)
        text = (SAMPLES / f"{run}.yaml").read_text()
        (folder / "manifest.yaml").write_text(text)
    result = invoke("diff", str(tmp_path / "float32"), str(tmp_path / "bfloat16"))
    assert result.exit_code == ExitCode.OK, result.output


def test_fewer_calls_in_b_are_paired_by_name_and_said(tmp_path: Path) -> None:
    text = (SAMPLES / "bfloat16.yaml").read_text()
    cut = text[: text.index("  - name: model.layers.1.self_attn")]
    cut += text[text.index("  - name: model.layers.2.self_attn") :]
    (tmp_path / "b.yaml").write_text(cut)
    shutil.copy(SAMPLES / "bfloat16.safetensors", tmp_path)
    result = invoke("diff", A, str(tmp_path / "b.yaml"), env={"COLUMNS": "120"})
    assert result.exit_code == ExitCode.OK, result.output
    assert (
        "2 calls paired by name; only in A: model.layers.1.self_attn; only in B: none"
        in result.stdout
    )


def test_runs_that_share_nothing_are_refused_in_one_line(tmp_path: Path) -> None:
    text = (SAMPLES / "bfloat16.yaml").read_text().replace("model.layers.", "blocks.")
    cut = text[: text.index("  - name: blocks.2.self_attn")]
    (tmp_path / "b.yaml").write_text(cut)
    shutil.copy(SAMPLES / "bfloat16.safetensors", tmp_path)
    line = assert_one_error_line(invoke("diff", A, str(tmp_path / "b.yaml")))
    assert line.startswith(f"sdpa: error: {tmp_path / 'b.yaml'}: no call pairs with those of ")
    assert line.endswith("3 calls against 2, so that pairing them in order would be a guess")


def test_a_folder_without_a_manifest_and_a_missing_run_are_refused(tmp_path: Path) -> None:
    line = assert_one_error_line(invoke("diff", str(tmp_path), A))
    assert line == (
        f"sdpa: error: {tmp_path}: is a folder without manifest.yaml: expected a capture's "
        "folder (sdpa capture --out DIR) or a manifest"
    )
    line = assert_one_error_line(invoke("diff", A, str(tmp_path / "missing")))
    assert line == (
        f"sdpa: error: {tmp_path / 'missing'}: not found: expected a capture's folder or a manifest"
    )


def test_a_call_that_cannot_be_read_is_named_and_the_others_compared(tmp_path: Path) -> None:
    text = (SAMPLES / "bfloat16.yaml").read_text()
    text = text.replace("bfloat16.safetensors:model.layers.2.v", "bfloat16.safetensors:nothing")
    (tmp_path / "b.yaml").write_text(text)
    shutil.copy(SAMPLES / "bfloat16.safetensors", tmp_path)
    result = invoke("diff", A, str(tmp_path / "b.yaml"))
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr.startswith("sdpa: error: model.layers.2.self_attn: ")
    assert len(result.stderr.splitlines()) == 1
    rows = [line.split() for line in result.stdout.splitlines()]
    assert ["2", "—", "—", "—", "—", "—", "error"] in rows  # its row says so
    assert "2 of 3 calls compared" in result.stdout


def test_the_help_states_the_rule_s_numbers() -> None:
    from sdpa_cli.check.diff import BOUND, JUMP

    text = " ".join(invoke("diff", "--help").stdout.split())
    assert f"default {BOUND:g}, 4× what" in text
    assert f"passes --bound and {JUMP:g}× any earlier call's" in text
