"""The case API (:mod:`sdpa_cli.api`): one :class:`~sdpa_cli.api.case.Case` runs the same
whoever gives it. A manifest's case reaches what the command line composes (split-KV
partials, a decode run), the Python API gives what ``sdpa check`` prints, and the rules
of a run hold for every caller."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attention_cases import causal_over_keys
from clirunner import assert_one_error_line, invoke, strict_json

from sdpa_cli.api.case import Case
from sdpa_cli.api.check import ManifestRun, run_check
from sdpa_cli.api.judge import check_case
from sdpa_cli.api.manifest import load_manifest
from sdpa_cli.check.settings import Overrides
from sdpa_cli.errors import ExitCode, SdpaError, SpecError

RANGES = ((0, 5), (5, 12), (12, 16))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Q, K, V (2, 3, 16, 4) and a causal case's split-KV partials over :data:`RANGES`,
    from a float64 loop per key range (``partials.json``), one with a wrong LSE
    (``wrong.json``), the prefill's output (``out.npy``)."""
    rng = np.random.default_rng(19)
    q, k, v = (rng.standard_normal((2, 3, 16, 4)) for _ in range(3))
    for name, a in zip("qkv", (q, k, v), strict=True):
        np.save(tmp_path / f"{name}.npy", a)
    for listing, wrong in (("partials.json", None), ("wrong.json", 1)):
        entries = []
        for n, (start, stop) in enumerate(RANGES):
            out, lse = causal_over_keys(q, k, v, start, stop)
            np.save(tmp_path / f"out{n}.npy", out)
            np.save(tmp_path / f"lse{n}{listing[0]}.npy", lse + (0.5 if n == wrong else 0.0))
            entries.append(
                {
                    "keys": f"{start}:{stop}",
                    "output": f"out{n}.npy",
                    "lse": f"lse{n}{listing[0]}.npy",
                }
            )
        (tmp_path / listing).write_text(json.dumps(entries))
    np.save(tmp_path / "out.npy", causal_over_keys(q, k, v, 0, 16)[0])
    return tmp_path


def _verdicts(document: dict[str, Any]) -> list[dict[str, bool]]:
    return [{c["name"]: c["passed"] for c in case["checks"]} for case in document["cases"]]


MANIFEST = """\
defaults: {q: q.npy, k: k.npy, v: v.npy, causal: true}
cases:
  - name: partials
    expect-partials: partials.json
  - name: wrong-lse
    expect-partials: wrong.json
  - name: decoded
    causal-align: lower-right
    decode: true
    expect-output: out.npy
  - name: decoded-wrong-export
    decode: true
    expect-output: out0.npy
"""


def test_a_manifest_case_reaches_partials_and_a_decode_run_as_the_command_line_does(
    folder: Path,
) -> None:
    (folder / "m.yaml").write_text(MANIFEST)
    manifest = invoke("check", "--manifest", str(folder / "m.yaml"), "--format", "json")
    assert manifest.exit_code == ExitCode.CHECK_FAILED, manifest.stderr
    got = _verdicts(strict_json(manifest.stdout))
    qkv = [str(folder / f"{n}.npy") for n in "qkv"]
    alone = [
        ["--expect-partials", str(folder / "partials.json")],
        ["--expect-partials", str(folder / "wrong.json")],
        ["--causal-align", "lower-right", "--decode", "--expect-output", str(folder / "out.npy")],
        ["--decode", "--expect-output", str(folder / "out0.npy")],
    ]
    for case, flags in zip(got, alone, strict=True):
        one = invoke("check", *qkv, "--causal", *flags, "--format", "json")
        assert _verdicts(strict_json(one.stdout)) == [case]
    assert got[0]["merged.output.close"]
    assert got[0]["partial[5:12].lse.close"]
    assert not got[1]["partial[5:12].lse.close"]
    assert not got[1]["merged.lse.close"]
    # the decoded steps match the prefill, and the export is judged beside them
    assert got[2]["decode.output.close"]
    assert got[2]["output.close"]
    assert got[3]["decode.output.close"]
    assert not got[3]["output.close"]


def test_the_python_api_judges_a_case_as_sdpa_check_does(folder: Path) -> None:
    qkv = tuple(str(folder / f"{n}.npy") for n in "qkv")
    case = Case(qkv, options={"causal": True}, partials=str(folder / "wrong.json"))
    result = check_case(case)
    printed = invoke("check", *qkv, "--causal", "--expect-partials", str(folder / "wrong.json"))
    assert result.report is not None
    assert not result.passed
    assert result.name == " ".join(qkv)
    lines = printed.stdout.splitlines()
    for check in result.report.checks:
        assert any(line.split()[:2] == [check.name, check.status.upper()] for line in lines)


def test_flags_beside_a_manifest_override_its_options_and_are_named_as_flags(
    folder: Path,
) -> None:
    (folder / "m.yaml").write_text("cases:\n  - {q: q.npy, k: k.npy, v: v.npy, scale: 2}\n")
    [case] = load_manifest(str(folder / "m.yaml"))
    assert case.where["scale"].endswith("cases[1]: scale")
    given = case.given({"scale": "oops", "causal": None})
    assert given.options == {"scale": "oops"}
    assert "scale" not in given.where
    with pytest.raises(SpecError, match=r"^--scale: "):
        check_case(case, Overrides(option_flags={"scale": "oops"}))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        (Case(("q.npy", "k.npy", "v.npy")), "--manifest: the manifest lists inputs"),
        (Case(expect={"output": "o.npy"}), "--manifest: the manifest lists inputs"),
        (Case(partials="p.yaml"), "--manifest: the manifest lists inputs"),
        (Case(decode=True), "--decode: checks the one case given; in a manifest, give its "),
    ],
)
def test_a_manifest_run_lists_its_own_inputs_for_every_caller(
    folder: Path, case: Case, message: str
) -> None:
    (folder / "m.yaml").write_text(MANIFEST)
    with pytest.raises(SpecError, match=f"^{re.escape(message)}"):
        run_check(case, manifest=ManifestRun(str(folder / "m.yaml")), jobs=1)


def test_a_cluster_runs_its_own_cases_for_every_caller(folder: Path) -> None:
    run = ManifestRun(str(folder / "m.yaml"), cluster="tcp://127.0.0.1:1")
    with pytest.raises(SpecError, match=r"^--jobs: the cluster's workers run the cases"):
        run_check(Case(), manifest=run, jobs=2)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("decode: maybe", "cases[1]: decode: expected true or false"),
        ("expect-partials: 3", "cases[1]: expect-partials: expected a file path, got 3"),
        (
            "expect-partials: s3://bucket/p.yaml",
            "cases[1]: expect-partials: a partials list is read from the local file system",
        ),
        ("expect-partials: ../p.yaml", "cases[1]: expect-partials: '../p.yaml' is outside"),
    ],
)
def test_a_manifest_refuses_a_bad_partials_or_decode_key(
    folder: Path, entry: str, message: str
) -> None:
    (folder / "m.yaml").write_text(f"cases:\n  - {{q: q.npy, k: k.npy, v: v.npy, {entry}}}\n")
    with pytest.raises(SdpaError, match=re.escape(message)):
        load_manifest(str(folder / "m.yaml"))
    line = assert_one_error_line(invoke("check", "--manifest", str(folder / "m.yaml")))
    assert message in line
