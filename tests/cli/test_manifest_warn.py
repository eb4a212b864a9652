"""A manifest's table says why a passing case warns: its first warning in a few words,
where the "first failure" column stood empty and only JSON said why."""

from __future__ import annotations

import json
from pathlib import Path

from clirunner import invoke

from sdpa_cli.errors import ExitCode

MODEL = Path(__file__).resolve().parents[2] / "samples" / "model" / "manifest.yaml"


def test_a_warning_case_says_why_in_the_table() -> None:
    """Layer 1 of the sample model passes its 4 checks but warns: head [0, 2] has Q = 0
    (every row uniform, a dead head) and head 0 parks two rows on key 0 (one-hot)."""
    result = invoke("check", "--manifest", str(MODEL), env={"COLUMNS": "80"})
    assert result.exit_code == ExitCode.CHECK_FAILED  # layer 2 fails
    rows = result.stdout.split("──\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert rows[:4] == [
        " model.layers.0.self_attn   PASS        4/4",
        " model.layers.1.self_attn   WARN        4/4   findings: head [0, 2] is dead (3",
        "                                              findings not gating: dead_head,",
        "                                              saturated)",
    ]


def test_json_names_the_first_warning_as_the_table_does() -> None:
    result = invoke("check", "--manifest", str(MODEL), "--format", "json")
    case = json.loads(result.stdout)["cases"][1]
    findings = next(c for c in case["checks"] if c["name"] == "findings")
    assert (findings["status"], findings["first"], findings["kinds"], findings["count"]) == (
        "warn",
        "head [0, 2] is dead",
        ["dead_head", "saturated"],
        3,
    )
