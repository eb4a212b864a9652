"""``sdpa report merge``: the reports of every shard of a manifest's run merge into the
unsharded run's report (the same JSON text, JUnit XML, table and exit code), and
anything else is refused with one line naming the file (exit 2)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from clirunner import assert_one_error_line, invoke, strict_json
from manifest_cases import write_manifest, write_shards

from sdpa_cli.errors import ExitCode


def check(*args: str) -> Result:
    return invoke("check", "--manifest", "m.yaml", "--jobs", "1", *args)


def shards(count: int, *args: str) -> list[str]:
    """The report files of shards 1..count of ``m.yaml``, written with ``args``."""
    return write_shards(count, *args)


def merge(*args: str) -> Result:
    return invoke("report", "merge", *args)


@pytest.mark.parametrize("broken", [True, False])
@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_merged_shards_are_the_unsharded_run(workdir: Path, count: int, broken: bool) -> None:
    write_manifest(workdir, broken=broken)
    whole = check("--format", "json", "--junit", "whole.xml")
    table = check()
    files = shards(count)
    random.Random(count).shuffle(files)  # any order
    merged = merge(*files, "--format", "json", "--junit", "merged.xml", "--report", "r.json")
    assert merged.exit_code == whole.exit_code == (ExitCode.BAD_INPUT if broken else 1)
    assert merged.stdout == whole.stdout  # the same JSON text
    assert (workdir / "r.json").read_text() == whole.stdout
    assert (workdir / "merged.xml").read_bytes() == (workdir / "whole.xml").read_bytes()
    assert merged.stderr == whole.stderr  # the unreadable case's line
    merged_table = merge(*files)
    assert merged_table.exit_code == whole.exit_code
    assert merged_table.stdout == table.stdout


def test_merged_annotations_are_the_unsharded_runs(workdir: Path) -> None:
    write_manifest(workdir)
    github = {"GITHUB_ACTIONS": "true"}
    whole = invoke("check", "--manifest", "m.yaml", "--jobs", "1", env=github)
    merged = invoke("report", "merge", *shards(2), env=github)
    assert merged.stdout == whole.stdout
    assert merged.stdout.startswith("::error ")


def test_a_passing_run_merges_to_exit_0(workdir: Path) -> None:
    write_manifest(workdir, broken=False)
    files = shards(2, "--rtol", "1", "--atol", "1", "--no-causal", "--fail-on", "none")
    result = merge(*files, "--format", "json")
    assert result.exit_code == ExitCode.OK
    doc = strict_json(result.stdout)
    assert (doc["passed"], doc["exit_code"], len(doc["cases"])) == (True, 0, 5)


# --- refusals ---------------------------------------------------------------------------


def edited(path: str, new: str, change: Any) -> str:
    """A copy of the report at ``path``, changed by ``change(doc)``, at ``new``."""
    doc = json.loads(Path(path).read_text())
    change(doc)
    Path(new).write_text(json.dumps(doc))
    return new


def refused(*args: str) -> str:
    return assert_one_error_line(merge(*args)).removeprefix("sdpa: error: ")


def test_merge_refuses_what_is_not_a_shard_report(workdir: Path) -> None:
    write_manifest(workdir)
    Path("plain.json").write_text('{"a": 1}')
    Path("list.json").write_text("[1, 2]")
    Path("broken.json").write_text("{")
    check("--report", "whole.json")
    invoke("check", "q.npy", "k.npy", "v.npy", "--report", "one.json")
    assert refused("plain.json") == "plain.json: is not a JSON report of sdpa check"
    assert refused("list.json") == "list.json: is not a JSON report of sdpa check"
    assert refused("broken.json").startswith("broken.json: invalid JSON at line 1")
    assert refused("q.npy") == "q.npy: is not UTF-8 text"
    assert refused("missing.json") == "missing.json: no such file"
    assert (
        refused("one.json") == "one.json: is the report of one case, not of a shard of a manifest"
    )
    assert refused("whole.json") == (
        "whole.json: is the report of a whole manifest, not of a shard "
        "(sdpa check --manifest M --shard I/N writes those)"
    )


def test_merge_refuses_a_damaged_shard_report(workdir: Path) -> None:
    write_manifest(workdir)
    one, two = shards(2)

    def status(doc: Any) -> None:
        doc["cases"][0]["checks"][0]["status"] = "maybe"

    def positions(doc: Any) -> None:
        doc["shard"]["positions"] = [1, 2, 3]

    def fewer(doc: Any) -> None:
        doc["cases"].pop()

    def index(doc: Any) -> None:
        doc["shard"]["index"] = True

    def findings(doc: Any) -> None:
        for check in doc["cases"][1]["checks"]:  # nan-key
            if "findings" in check:
                check["findings"] = [1]

    assert refused(one, edited(two, "x.json", status)) == (
        "x.json: cases[0].checks[0].status: expected pass, warn or fail, got 'maybe'"
    )
    assert refused(one, edited(two, "x.json", positions)) == (
        "x.json: shard.positions: not those of shard 2/2 of 6 cases"
    )
    assert refused(one, edited(two, "x.json", fewer)) == (
        "x.json: holds 2 cases; shard 2/2 of 6 cases has 3"
    )
    assert refused(one, edited(two, "x.json", index)) == (
        "x.json: shard.index: expected int, got True"
    )
    found = refused(edited(one, "y.json", findings), two)
    assert re.fullmatch(
        r"y\.json: cases\[1\]\.checks\[\d+\]\.findings: expected a list of findings with messages",
        found,
    )


def test_merge_refuses_shards_of_other_runs(workdir: Path) -> None:
    write_manifest(workdir)
    one, _ = shards(2)
    (workdir / "other.yaml").write_text((workdir / "m.yaml").read_text())
    invoke("check", "--manifest", "other.yaml", "--shard", "2/2", "--report", "other.json")
    check("--shard", "2/2", "--rtol", "1", "--atol", "1", "--report", "flags.json")
    check("--shard", "2/3", "--report", "thirds.json")
    assert refused(one, "other.json") == (
        f"other.json: is a shard of another run than {one}: manifest 'other.yaml', not 'm.yaml'"
    )
    assert refused(one, "flags.json") == (
        f"flags.json: is a shard of another run than {one}: another manifest's cases, or "
        "other settings"
    )
    assert refused(one, "thirds.json") == (
        f"thirds.json: is a shard of another run than {one}: 3 shards, not 2"
    )
    (workdir / "m.yaml").write_text((workdir / "m.yaml").read_text().replace("good", "fine"))
    check("--shard", "2/2", "--report", "edited.json")
    assert refused(one, "edited.json") == (
        f"edited.json: is a shard of another run than {one}: another manifest's cases, or "
        "other settings"
    )


def test_merge_refuses_a_missing_or_repeated_shard(workdir: Path) -> None:
    write_manifest(workdir)
    one, two, three, four = shards(4)
    assert (
        refused(one, three)
        == "m.yaml: shards 2/4, 4/4 are missing; merge the reports of every shard"
    )
    assert (
        refused(one, two, three) == "m.yaml: shard 4/4 is missing; merge the reports of every shard"
    )
    Path("again.json").write_bytes(Path(two).read_bytes())
    assert refused(one, two, three, four, "again.json") == (
        f"again.json: is shard 2/4 again (as {two}); give each shard once"
    )


def test_merge_needs_a_file(workdir: Path) -> None:
    result = merge()
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "Missing argument 'SHARD.json...'" in result.stderr


def test_report_help_has_examples() -> None:
    for args in (["report", "--help"], ["report", "merge", "--help"]):
        result = invoke(*args)
        assert result.exit_code == 0
        assert "sdpa report merge" in result.stdout


# --- a hostile shard report: shown printable and short, JUnit still XML ------------------

HOSTILE_NAME = "x" * 100_000 + "\x1b[31m"
HOSTILE_ERROR = "e" * 100_000 + "\x1b]0;pwn\x07"


def hostile(doc: dict[str, Any]) -> None:
    """A case's error of 100,000 characters ending in terminal escapes (the case, named
    in the manifest with 100,000 characters ending in one, made an error, as the report
    then says); a failed check's summary with an ESC and a byte that is not UTF-8 (a
    lone surrogate)."""
    doc["cases"][0] |= {"error": HOSTILE_ERROR, "passed": False}
    doc |= {"passed": False, "exit_code": 2}
    failed = [c for case in doc["cases"][1:] for c in case["checks"] if c["status"] == "fail"]
    failed[0]["summary"] = "bad\x1b[2J\udcff"


def test_a_hostile_shard_report_is_shown_printable_and_short(workdir: Path) -> None:
    import xml.etree.ElementTree as ET  # imported here: this test alone reads XML

    write_manifest(workdir)
    manifest = (workdir / "m.yaml").read_text()
    escaped = HOSTILE_NAME.replace("\x1b", "\\e")  # YAML's escape of ESC
    (workdir / "m.yaml").write_text(manifest.replace("name: good", f'name: "{escaped}"'))
    one, two = shards(2)
    edited(one, "h.json", hostile)
    result = merge("h.json", two, "--junit", "j.xml", "--report", "r.json")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "\x1b" not in result.output
    assert "\x07" not in result.output
    name = "x" * 100 + "…" + "x" * 91 + "\\x1b[31m"  # cut in the middle to 200
    line = f"sdpa: error: {name}: {'e' * 497}..."  # cut to 500
    assert line in result.stderr.splitlines()
    assert max(len(line) for line in result.stderr.splitlines()) == len(line) == 715
    assert "bad\\x1b[2J\\xff" in result.stdout  # the table's first failure
    root = ET.parse("j.xml").getroot()
    suite = root.find("testsuite")
    assert suite is not None
    assert suite.get("name") == name
    assert root.findtext("testsuite/testcase/error") == "e" * 497 + "..."
    messages = [f.get("message") for f in root.iter("failure")]
    assert "bad\\x1b[2J\\xff" in messages
    # The merged JSON is the shards' data, exact (json.dumps escapes it).
    shard_name = json.loads(Path(one).read_text())["cases"][0]["name"]
    assert json.loads(Path("r.json").read_text())["cases"][0]["name"] == shard_name
    assert json.loads(Path("r.json").read_text())["cases"][0]["error"] == HOSTILE_ERROR
    annotations = invoke("report", "merge", "h.json", two, env={"GITHUB_ACTIONS": "true"})
    assert "\x1b" not in annotations.output
    assert "::error file=" in annotations.stdout
    assert "bad\\x1b[2J\\xff" in annotations.stdout


def test_junit_escapes_what_xml_forbids_in_every_run() -> None:
    import xml.etree.ElementTree as ET  # imported here: this test alone reads XML

    from sdpa_cli.check.records import CaseResult
    from sdpa_cli.report import junit_xml

    error = "bad \x00\x1b\udcff\ufffe\ttab\nline é"
    root = ET.fromstring(junit_xml([CaseResult("c\x1b", error=error)]))
    assert root.find("testsuite").get("name") == "c\\x1b"  # type: ignore[union-attr]
    assert root.findtext("testsuite/testcase/error") == "bad \\x00\\x1b\\xff\\ufffe\ttab\nline é"


def test_a_kernel_rule_failure_merges_to_the_unsharded_runs_table(workdir: Path) -> None:
    """Regression: a shard's report read back lost the kernel rule's factor and the
    factor that would pass, so the merged table said "tolerance: rtol 0, atol 0" and
    "would pass with: no tolerance" where the run said "--fudge 554" (now that the
    error is called no rounding, no --fudge is offered, and the diagnosis must come
    through the merge the same)."""
    from sdpa_cli.files.samples import samples_dir

    manifest = str(samples_dir() / "check" / "checks.yaml")  # float16 exports
    whole = invoke("check", "--manifest", manifest, "--jobs", "1")
    merged = merge(*write_shards(2, manifest=manifest))
    assert merged.exit_code == whole.exit_code == ExitCode.CHECK_FAILED
    assert merged.stdout == whole.stdout
    assert "judged: kernel: ≤ 2× the plain float16 computation's" in merged.stdout
    assert "not rounding: 9.1e+02× the plain computation's RMS error" in merged.stdout
