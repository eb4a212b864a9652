"""The JSON Schemas of sdpa's documents (:mod:`sdpa_cli.schemas`): each is a valid draft
2020-12 schema, agrees with the code's lists (finding kinds, severities, statuses, exit
codes), and holds what every command writes on the samples: a failing check, a
manifest, shards and their merge, NaN and infinities, float16 overflow. The hook in
``clirunner.invoke`` validates every other CLI test's documents; the last tests prove
that it rejects what does not fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from clirunner import (
    decode_non_finite,
    invoke,
    only_case,
    schema_name,
    strict_json,
    validate_output,
)

from sdpa_cli import __version__, names
from sdpa_cli.diagnosis.frameworks import OTHER
from sdpa_cli.errors import ExitCode
from sdpa_cli.files.samples import samples_dir
from sdpa_cli.schemas import NAMES, SCHEMA_VERSION, schema
from sdpa_cli.text import NON_FINITE_JSON

SAMPLES = samples_dir()
CHECK = SAMPLES / "check"
QKV = [str(CHECK / f"{n}.npy") for n in ("q", "k", "v")]
HEAD = ["schema_version", "sdpa_version"]


@pytest.fixture(scope="module")
def jsonschema() -> Any:
    """The validator library (a dev extra): these tests skip cleanly without it."""
    return pytest.importorskip("jsonschema")


def assert_valid(jsonschema: Any, document: Any, name: str) -> None:
    """``document`` starts with the two versions and fits schema ``name``."""
    assert list(document)[:2] == HEAD
    assert (document["schema_version"], document["sdpa_version"]) == (SCHEMA_VERSION, __version__)
    validator = jsonschema.Draft202012Validator(schema(name))
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]
    assert errors == []


def run_json(*args: str, code: int = ExitCode.OK) -> Any:
    result = invoke(*args, "--format", "json")
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    return strict_json(result.stdout)


# --- the schema files ---------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_each_schema_is_a_valid_draft_2020_12_schema(jsonschema: Any, name: str) -> None:
    whole = schema(name)
    jsonschema.Draft202012Validator.check_schema(whole)
    assert whole["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert whole["required"][:2] == HEAD
    assert "schema_version" in whole["description"]  # the version rule, in every file
    # Whole: every reference points inside the schema itself.
    text = json.dumps(whole)
    assert "defs.json#" not in text
    refs = {r.split("/")[-1] for r in _refs(whole)}
    assert refs <= set(whole["$defs"]), refs - set(whole["$defs"])


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if "$ref" in node else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_the_schema_files_point_into_defs() -> None:
    folder = Path(__file__).parents[1] / "sdpa_cli" / "schemas"
    on_disk = sorted(p.stem for p in folder.glob("*.json"))
    assert on_disk == sorted([*NAMES, "defs"])
    check_file = json.loads((folder / "check.json").read_text())
    assert check_file["properties"]["cases"]["items"] == {"$ref": "defs.json#/$defs/case"}


def test_the_files_on_disk_validate_with_defs_beside_them(jsonschema: Any) -> None:
    """What a tool that loads the folder sees: check.json resolves defs.json by its $id."""
    referencing = pytest.importorskip("referencing")
    folder = Path(__file__).parents[1] / "sdpa_cli" / "schemas"
    defs = json.loads((folder / "defs.json").read_text())
    registry = referencing.Registry().with_resource(
        defs["$id"], referencing.Resource.from_contents(defs)
    )
    check_file = json.loads((folder / "check.json").read_text())
    validator = jsonschema.Draft202012Validator(check_file, registry=registry)
    doc = run_json("check", *QKV, "--causal", "--expect-output", str(CHECK / "out.npy"))
    assert list(validator.iter_errors(doc)) == []
    only_case(doc)["checks"][0]["status"] = "ok"
    assert [e.message for e in validator.iter_errors(doc)][:1] == [
        "'ok' is not one of ['pass', 'warn', 'fail']"
    ]


def test_an_unknown_schema_is_refused() -> None:
    with pytest.raises(ValueError, match="no schema 'checks'; the schemas are compute, "):
        schema("checks")


OPTIONS = "/$defs/options/properties"
ENUMS: dict[tuple[str, str], tuple[Any, ...]] = {
    ("defs", "/$defs/kind"): names.ALL_KINDS,
    ("defs", "/$defs/case/properties/backend/anyOf/0"): names.BACKENDS,
    ("defs", "/$defs/setup/properties/backend"): names.BACKENDS,
    ("defs", "/$defs/severity"): names.SEVERITIES,
    ("defs", "/$defs/status"): names.STATUSES,
    ("defs", "/$defs/non_finite"): tuple(NON_FINITE_JSON),
    ("defs", f"{OPTIONS}/framework/anyOf/0"): names.FRAMEWORKS,
    ("defs", f"{OPTIONS}/causal_align"): names.ALIGNMENTS,
    ("defs", f"{OPTIONS}/mask_true_means"): names.MASK_TRUE_MEANS,
    ("defs", f"{OPTIONS}/layout"): names.LAYOUTS,
    ("defs", f"{OPTIONS}/dtype"): names.FORMATS,
    ("defs", f"{OPTIONS}/accumulate"): names.FORMATS,
    ("defs", f"{OPTIONS}/softmax_dtype"): names.FORMATS,
    ("defs", f"{OPTIONS}/logits_dtype"): names.FORMATS,
    ("check", "/properties/exit_code"): tuple(c for c in ExitCode if c != ExitCode.INTERRUPTED),
    ("compute", "/properties/stages/items"): names.STAGES,
    ("frameworks", "/properties/frameworks/properties/answers/items/properties/as"): (
        names.FRAMEWORKS
    ),
    ("frameworks", "/properties/frameworks/properties/disagreements/items/properties/kind"): (
        *names.FRAMEWORK_DIFFERENCES,
        OTHER,
    ),
    ("grad", "/properties/gradients/propertyNames"): names.GRADIENTS,
    ("grad", "/properties/dout/properties/source"): (*names.DOUT_SOURCES, "file"),
    ("report-model", "/properties/metrics/propertyNames"): names.MODEL_METRICS,
    ("report-model", "/properties/notable/items/properties/kind"): names.NOTABLE_HEADS,
    ("diff", "/properties/pairing/properties/by"): names.PAIRINGS,
    ("diff", "/properties/calls/items/properties/differences/propertyNames"): names.COMPARED,
    ("diff", "/properties/calls/items/properties/differ/items"): (*names.COMPARED[:4], "mask"),
    ("diff", "/properties/calls/items/properties/kernel/anyOf/0/properties/run"): names.DIFF_RUNS,
    ("diff", "/properties/calls/items/properties/kernel_a/anyOf/0/properties/run"): names.DIFF_RUNS,
    ("diff", "/properties/calls/items/properties/where/anyOf/0"): names.DIVERGENCES,
    ("diff", "/properties/first/anyOf/0/properties/where"): names.DIVERGENCES,
    ("diff", "/properties/exit_code"): (ExitCode.OK, ExitCode.CHECK_FAILED, ExitCode.BAD_INPUT),
}
"""Every enum of every schema file (its file and JSON pointer) → the list of names it
must equal: the schemas cannot drift from :mod:`sdpa_cli.names`."""


def _enums(node: Any, pointer: str = "") -> dict[str, list[Any]]:
    """Every ``enum`` under ``node``, by the JSON pointer of the object holding it."""
    found: dict[str, list[Any]] = {}
    if isinstance(node, dict):
        if "enum" in node:
            found[pointer] = node["enum"]
        for key, value in node.items():
            found |= _enums(value, f"{pointer}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found |= _enums(value, f"{pointer}/{i}")
    return found


SCHEMAS = Path(__file__).parent.parent / "sdpa_cli" / "schemas"


def write_enums() -> None:
    """Every enum of :data:`ENUMS` written into its schema file from the names table
    (``python tests/test_schemas.py --regen``, after a name is added): the enums are
    generated, and the test below holds them to it."""
    for name in sorted({file for file, _ in ENUMS}):
        path = SCHEMAS / f"{name}.json"
        data = json.loads(path.read_text())
        for (file, pointer), names_ in ENUMS.items():
            if file != name:
                continue
            node = data
            for part in pointer.strip("/").split("/"):
                node = node[int(part)] if isinstance(node, list) else node[part]
            node["enum"] = list(names_)
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def test_every_enum_of_every_schema_is_a_list_of_the_names_table() -> None:
    folder = SCHEMAS
    found = {
        (path.stem, pointer): enum
        for path in sorted(folder.glob("*.json"))
        for pointer, enum in _enums(json.loads(path.read_text())).items()
    }
    assert sorted(found) == sorted(ENUMS)
    for key, enum in found.items():
        assert enum == list(ENUMS[key]), key


def test_the_schemas_list_what_the_code_lists() -> None:
    defs = schema("check")["$defs"]
    assert defs["schema_version"] == {"const": SCHEMA_VERSION, "description": ANY_TEXT}


class _AnyText(str):
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)

    __hash__ = str.__hash__


ANY_TEXT = _AnyText()


# --- every command's document, on the samples ------------------------------------------------


@pytest.mark.parametrize(
    ("sample", "flags"),
    [
        ("causal.yaml", []),
        ("padded_nan.yaml", []),  # NaN inputs: "NaN" strings in the stages
        ("fp16_overflow.yaml", ["--dtype", "float16"]),  # overflow findings, emulation
        ("kv_cache.yaml", []),
        # the schema once listed "ignore", which no option is
        ("causal.yaml", ["--mask-true-means", "masked", "--as", "jax", "--layout", "bhsd"]),
    ],
)
def test_compute_json_and_yaml(jsonschema: Any, sample: str, flags: list[str]) -> None:
    doc = run_json("compute", str(SAMPLES / sample), *flags)
    assert_valid(jsonschema, doc, "compute")
    result = invoke("compute", str(SAMPLES / sample), *flags, "--format", "yaml")
    assert result.exit_code == ExitCode.OK
    loaded = yaml.safe_load(result.stdout)
    assert_valid(jsonschema, loaded, "compute")  # .nan and .inf are numbers
    assert json.dumps(decode_non_finite(doc)) == json.dumps(loaded)


def test_non_finite_numbers_are_the_schema_strings(jsonschema: Any) -> None:
    doc = run_json("compute", str(SAMPLES / "padded_nan.yaml"))
    assert doc["options"]["mask_value"] == "-Infinity"
    cells = json.dumps(doc["raw"])
    assert '"NaN"' in cells
    bad = {**doc, "raw": [["nan"]]}  # a lowercase string is not one of the three
    with pytest.raises(AssertionError, match="raw/0: "):
        validate_output(["compute", "--format", "json"], json.dumps(bad))


def test_compute_frameworks(jsonschema: Any) -> None:
    for sample in ("causal.yaml", "hf_mask.yaml"):
        doc = run_json("compute", str(SAMPLES / sample), "--frameworks")
        assert_valid(jsonschema, doc, "frameworks")
        assert doc["options"] == run_json("compute", str(SAMPLES / sample))["options"]


@pytest.mark.parametrize(
    "args",
    [
        ["causal.yaml"],
        ["scorecard.yaml", "--query", "0"],
        ["scale_comparison.yaml", "--compare-scales"],
        ["causal.yaml", "--backward", "--dout", "random"],
    ],
)
def test_explain(jsonschema: Any, args: list[str]) -> None:
    doc = run_json("explain", str(SAMPLES / args[0]), *args[1:])
    assert_valid(jsonschema, doc, "explain")


def test_grad(jsonschema: Any) -> None:
    doc = run_json("grad", str(SAMPLES / "fp16_overflow.yaml"), "--check-numeric")
    assert_valid(jsonschema, doc, "grad")
    assert doc["numeric_check"]["passed"] is True
    assert_valid(jsonschema, run_json("grad", str(SAMPLES / "vanishing.yaml")), "grad")


def test_inspect_with_a_refused_file(jsonschema: Any, workdir: Path) -> None:
    (workdir / "broken.npy").write_bytes(b"not numpy")
    paths = [str(SAMPLES / "cross.npz"), str(SAMPLES / "padded_nan.yaml"), "broken.npy"]
    doc = run_json("inspect", *paths, code=ExitCode.BAD_INPUT)
    assert_valid(jsonschema, doc, "inspect")
    assert [f["error"] is None for f in doc["files"]] == [True, True, False]


def test_samples_and_report_model(jsonschema: Any) -> None:
    assert_valid(jsonschema, run_json("samples"), "samples")
    doc = run_json("report", "model", str(SAMPLES / "model" / "manifest.yaml"))
    assert_valid(jsonschema, doc, "report-model")


@pytest.mark.parametrize(
    ("run", "code"),
    [
        ("bfloat16", ExitCode.OK),
        ("rotary_bug", ExitCode.CHECK_FAILED),
        ("kernel_bug", ExitCode.CHECK_FAILED),
    ],
)
def test_diff(jsonschema: Any, run: str, code: int) -> None:
    a, b = (str(SAMPLES / "diff" / f"{name}.yaml") for name in ("float32", run))
    doc = run_json("diff", a, b, code=code)
    assert_valid(jsonschema, doc, "diff")
    assert doc["exit_code"] == code


# --- check: one shape for one case, a manifest, shards and their merge -----------------------


def test_a_single_case_is_the_one_case_of_the_manifest_shape(jsonschema: Any) -> None:
    ok = run_json("check", *QKV, "--causal", "--expect-output", str(CHECK / "out.npy"))
    bad = run_json(
        "check",
        *QKV,
        "--causal",
        "--expect-output",
        str(CHECK / "out_scale_bug.npy"),
        code=ExitCode.CHECK_FAILED,
    )
    manifest = run_json(
        "check", "--manifest", str(CHECK / "checks.yaml"), code=ExitCode.CHECK_FAILED
    )
    for doc in (ok, bad, manifest):
        assert_valid(jsonschema, doc, "check")
        assert list(doc) == [*HEAD, "manifest", "passed", "exit_code", "cases"]
    assert only_case(ok)["passed"] is ok["passed"] is True
    case = only_case(bad)
    assert (bad["passed"], bad["exit_code"], case["passed"], case["error"]) == (
        False,
        1,
        False,
        None,
    )
    assert case["name"] == " ".join(QKV)  # as the JUnit suite names it
    (close,) = [c for c in case["checks"] if c["name"] == "output.close"]
    assert close["status"] == "fail"
    assert list(case) == list(manifest["cases"][0])  # the same keys, in the same order


def test_check_decode(jsonschema: Any) -> None:
    doc = run_json("check", *QKV, "--causal", "--expect-output", str(CHECK / "out.npy"), "--decode")
    assert_valid(jsonschema, doc, "check")
    assert "decode.output.close" in [c["name"] for c in only_case(doc)["checks"]]


def test_shards_and_their_merge(jsonschema: Any, workdir: Path) -> None:
    manifest = str(CHECK / "checks.yaml")
    whole = run_json("check", "--manifest", manifest, code=ExitCode.CHECK_FAILED)
    for i in (1, 2):
        result = invoke(
            "check", "--manifest", manifest, "--shard", f"{i}/2", "--report", f"s{i}.json"
        )
        assert result.exit_code in (ExitCode.OK, ExitCode.CHECK_FAILED)
        shard = strict_json((workdir / f"s{i}.json").read_text())
        assert_valid(jsonschema, shard, "check")
        assert list(shard)[:4] == [*HEAD, "manifest", "shard"]
    merged = run_json("report", "merge", "s1.json", "s2.json", code=ExitCode.CHECK_FAILED)
    assert_valid(jsonschema, merged, "check")
    assert merged == whole


def test_merge_refuses_a_report_of_another_schema_version(workdir: Path) -> None:
    manifest = str(CHECK / "checks.yaml")
    for i in (1, 2):
        invoke("check", "--manifest", manifest, "--shard", f"{i}/2", "--report", f"s{i}.json")
    old = json.loads((workdir / "s2.json").read_text())
    del old["schema_version"]
    (workdir / "s2.json").write_text(json.dumps(old))
    result = invoke("report", "merge", "s1.json", "s2.json")
    assert result.exit_code == ExitCode.BAD_INPUT
    assert result.stderr.startswith(
        "sdpa: error: s2.json: is a report of schema_version None, not 1; "
    )


# --- the hook of every CLI test ----------------------------------------------------------------


def test_the_hook_rejects_a_document_that_does_not_fit(jsonschema: Any) -> None:
    doc = run_json("check", *QKV, "--causal", "--expect-output", str(CHECK / "out.npy"))
    validate_output(["check", "--format", "json"], json.dumps(doc))  # fits
    only_case(doc)["checks"][0]["status"] = "ok"
    with pytest.raises(AssertionError, match=r"cases/0/checks/0/status: 'ok' is not one of"):
        validate_output(["check", "--format", "json"], json.dumps(doc))


def test_a_verdict_that_contradicts_itself_does_not_fit(jsonschema: Any) -> None:
    doc = run_json(
        "check",
        *QKV,
        "--causal",
        "--expect-output",
        str(CHECK / "out_scale_bug.npy"),
        code=ExitCode.CHECK_FAILED,
    )
    args = ["check", "--format", "json"]
    lying = {**doc, "passed": True}  # exit_code 1
    with pytest.raises(AssertionError, match="False was expected"):
        validate_output(args, json.dumps(lying))
    case = only_case(doc)
    (close,) = [c for c in case["checks"] if c["status"] == "fail"]
    close["passed"] = True
    with pytest.raises(AssertionError, match=r"cases/0/checks/\d+/passed: False was expected"):
        validate_output(args, json.dumps(doc))


def test_the_hook_rejects_a_document_without_schema_version(jsonschema: Any) -> None:
    doc = run_json("samples")
    del doc["schema_version"]
    with pytest.raises(AssertionError, match="a samples document without schema_version"):
        validate_output(["samples", "--format", "json"], json.dumps(doc))


def test_the_hook_reads_yaml_and_the_report_file(jsonschema: Any, workdir: Path) -> None:
    result = invoke("compute", str(SAMPLES / "causal.yaml"), "--format", "yaml")
    broken = result.stdout.replace("scale: ", "scale: not a number # ", 1)
    with pytest.raises(AssertionError, match="scale: 'not a number' is not of type 'number'"):
        validate_output(["compute", "--format", "yaml"], broken)
    (workdir / "r.json").write_text(json.dumps({"schema_version": 1, "cases": []}))
    with pytest.raises(AssertionError, match="'sdpa_version' is a required property"):
        validate_output(["check", "q.npy", "--report", "r.json"], "PASS: 4 checks passed\n")
    validate_output(["check", "q.npy", "--report", "r.json"], "", wrote=False)  # not written


def test_the_hook_knows_each_command_s_schema() -> None:
    assert schema_name(["compute", "x.yaml", "--format", "json"]) == "compute"
    assert schema_name(["compute", "x.yaml", "--frameworks"]) == "frameworks"
    assert schema_name(["report", "merge", "a.json"]) == "check"
    assert schema_name(["report", "model", "m.yaml"]) == "report-model"
    assert schema_name(["diff", "runs/a", "runs/b"]) == "diff"
    assert schema_name(["--debug", "inspect", "a.npz"]) == "inspect"
    assert schema_name(["capture", "script.py"]) is None


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: python tests/test_schemas.py --regen")
    write_enums()
