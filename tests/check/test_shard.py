"""``sdpa check --manifest M --shard I/N``: the round-robin rule (every case in exactly
one shard, sizes within one, deterministic), its parsing, the run's fingerprint, and
what a shard's report says of it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from clirunner import assert_one_error_line, invoke, strict_json
from manifest_cases import write_manifest

from sdpa_cli.api.manifest import Shard, fingerprint, load_manifest
from sdpa_cli.check.settings import Overrides
from sdpa_cli.errors import ExitCode, SpecError


@pytest.mark.parametrize(
    ("text", "shard"), [("1/1", Shard(1, 1)), ("2/4", Shard(2, 4)), (" 3 / 3 ", Shard(3, 3))]
)
def test_shard_parses_i_of_n(text: str, shard: Shard) -> None:
    assert Shard.parse(text) == shard
    assert str(shard) == f"{shard.index}/{shard.count}"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0/3", "expected I/N with 1 ≤ I ≤ N, got 0/3"),
        ("4/3", "expected I/N with 1 ≤ I ≤ N, got 4/3"),
        ("0/0", "expected I/N with 1 ≤ I ≤ N, got 0/0"),
        ("2", "expected I/N (such as 2/4), got 2"),
        ("a/b", "expected I/N (such as 2/4), got a/b"),
        ("-1/2", "expected I/N (such as 2/4), got -1/2"),
    ],
)
def test_shard_refuses_what_is_not_i_of_n(text: str, problem: str) -> None:
    with pytest.raises(SpecError) as info:
        Shard.parse(text)
    assert str(info.value) == f"--shard: {problem}"


@pytest.mark.parametrize("total", [0, 1, 2, 5, 12, 13])
@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
def test_every_case_is_in_exactly_one_shard_and_shards_are_balanced(total: int, count: int) -> None:
    shards = [Shard(i, count).positions(total) for i in range(1, count + 1)]
    assert sorted(p for s in shards for p in s) == list(range(1, total + 1))
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    assert all(s == sorted(s) for s in shards)  # manifest order within a shard
    assert shards == [Shard(i, count).positions(total) for i in range(1, count + 1)]


def test_the_rule_is_round_robin() -> None:
    assert Shard(2, 3).positions(10) == [2, 5, 8]
    assert Shard(4, 4).positions(3) == []


def test_fingerprint_names_the_cases_and_the_command_line(tmp_path: Path) -> None:
    cases = load_manifest(str(write_manifest(tmp_path)))
    print_ = fingerprint(cases, Overrides())
    assert print_.startswith("sha256:")
    assert fingerprint(load_manifest(str(tmp_path / "m.yaml")), Overrides()) == print_
    assert fingerprint(cases[1:], Overrides()) != print_
    assert fingerprint(cases, Overrides(option_flags={"causal": True})) != print_


def shard_json(manifest: Path, shard: str, *args: str) -> tuple[int, Any]:
    result = invoke("check", "--manifest", str(manifest), "--shard", shard, "--jobs", "1",
                    "--format", "json", *args)  # fmt: skip
    assert "Traceback" not in result.output
    return result.exit_code, strict_json(result.stdout)


def test_a_shard_runs_its_cases_and_its_report_says_which(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path)  # 6 cases
    names = [c.name for c in load_manifest(str(manifest))]
    seen: list[str] = []
    for i in (1, 2, 3):
        code, doc = shard_json(manifest, f"{i}/3")
        assert list(doc)[:4] == ["schema_version", "sdpa_version", "manifest", "shard"]
        block = doc["shard"]
        assert (block["index"], block["count"], block["manifest_cases"]) == (i, 3, 6)
        assert block["positions"] == [i, i + 3]
        assert block["fingerprint"].startswith("sha256:")
        got = [c["name"] for c in doc["cases"]]
        assert got == [names[p - 1] for p in block["positions"]]
        seen += got
        # The shard's exit code and verdict are those of its own cases.
        errors = any(c["error"] for c in doc["cases"])
        failed = not all(c["passed"] for c in doc["cases"])
        assert code == doc["exit_code"] == (2 if errors else 1 if failed else 0)
        assert doc["passed"] is (code == 0)
    assert sorted(seen) == sorted(names)
    # Deterministic: the same shard twice is the same report.
    assert shard_json(manifest, "2/3") == shard_json(manifest, "2/3")


def test_a_shard_with_no_case_passes(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path, broken=False)  # 5 cases
    code, doc = shard_json(manifest, "7/7")
    assert code == ExitCode.OK
    assert doc["cases"] == []
    assert doc["shard"]["positions"] == []


def test_a_shard_table_is_titled_with_its_shard(tmp_path: Path, workdir: Path) -> None:
    write_manifest(workdir, broken=False)
    result = invoke("check", "--manifest", "m.yaml", "--shard", "1/2", "--jobs", "1")
    assert result.exit_code == ExitCode.CHECK_FAILED  # good, nan-key, causal-wrong
    assert result.stdout.startswith("m.yaml · shard 1/2\n")
    assert "causal-wrong" in result.stdout
    assert "bad" not in result.stdout.split()


def test_a_shard_report_file_is_its_json(workdir: Path) -> None:
    write_manifest(workdir)
    result = invoke("check", "--manifest", "m.yaml", "--shard", "2/2", "--report", "s.json",
                    "--format", "json", "--jobs", "1")  # fmt: skip
    assert result.exit_code == ExitCode.BAD_INPUT  # bad, loose, broken
    assert json.loads((workdir / "s.json").read_text()) == strict_json(result.stdout)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["q.npy", "k.npy", "v.npy", "--shard", "1/2"],
         "--shard: runs the cases of a manifest; give --manifest FILE"),
        (["q.npy", "k.npy", "v.npy", "--cluster", "tcp://127.0.0.1:1"],
         "--cluster: runs the cases of a manifest; give --manifest FILE"),
        (["q.npy", "k.npy", "v.npy", "--cluster-timeout", "3"],
         "--cluster-timeout: runs the cases of a manifest; give --manifest FILE"),
        (["--manifest", "m.yaml", "--cluster-timeout", "3"],
         "--cluster-timeout: bounds the wait for a --cluster scheduler; give --cluster ADDRESS"),
        (["--manifest", "m.yaml", "--shard", "3/2"],
         "--shard: expected I/N with 1 ≤ I ≤ N, got 3/2"),
        (["--manifest", "m.yaml", "--shard", "half"],
         "--shard: expected I/N (such as 2/4), got half"),
    ],
)  # fmt: skip
def test_shard_usage_errors(workdir: Path, args: list[str], message: str) -> None:
    write_manifest(workdir)
    assert assert_one_error_line(invoke("check", *args)) == f"sdpa: error: {message}"
