"""Options are kept as typed and as resolved: what speaks to the user says the user's own
numbers under every ``--as``.

``--window 4,0`` means four keys left of the query in PyTorch's, FlashAttention's, JAX's
and ONNX's terms, and four counting the query (three keys) in Hugging Face's: the engine
computes the resolved window, while the header, the hints and ``--frameworks`` say 4,0,
and a window one key wider than meant is named as 5,0 under every ``--as``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from clirunner import invoke
from reference import attention

from sdpa_cli.engine.conventions import CONVENTIONS
from sdpa_cli.engine.options import parse_options
from sdpa_cli.errors import ExitCode
from sdpa_cli.names import FRAMEWORKS

L, E = 24, 8


def given(framework: str) -> tuple[str, ...]:
    """Q, K and V, ``--as framework``, causal, ``--window 4,0``."""
    return ("q.npy", "k.npy", "v.npy", "--as", framework, "--causal", "--window", "4,0")


def typed_keys(framework: str) -> int:
    """Keys left of the query that ``--window 4,0`` means under ``--as framework``."""
    return CONVENTIONS[framework].window((4, 0))[0]


@pytest.fixture
def files(workdir: Path) -> Path:
    rng = np.random.default_rng(3)
    for name in "qkv":
        np.save(workdir / f"{name}.npy", rng.normal(scale=2.0, size=(1, 2, L, E)))
    return workdir


def test_parse_options_keeps_the_typed_window_beside_the_resolved_one() -> None:
    o = parse_options({"framework": "hf", "window": "4,0", "causal": True})
    assert o.window == (3, 0)  # what the engine computes
    assert o.typed["window"] == (4, 0)  # what the user typed
    assert o.as_typed("window") == (4, 0)
    assert o.typed_window((5, 0)) == (6, 0)
    assert "causal_align" not in o.typed  # --as's default, not typed
    assert o.as_typed("causal_align") == "lower-right"
    plain = parse_options({"window": "4,0"})
    assert plain.window == plain.typed["window"] == (4, 0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_header_says_the_window_as_typed(files: Path, framework: str) -> None:
    result = invoke("compute", *given(framework), "--stages", "output")
    assert result.exit_code == ExitCode.OK, result.output
    (line,) = [x for x in result.stdout.splitlines() if "│ window" in x]
    if CONVENTIONS[framework].window_counts_query:
        assert "window     4,0 as hf counts it (with the query): 3 left, 0 right" in line
    else:
        assert "window     4 left, 0 right" in line


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_window_one_key_wider_is_named_in_the_users_terms(files: Path, framework: str) -> None:
    """The kernel saw one key more on the left than ``--window 4,0`` means under
    ``--as``: the hint says ``--window 5,0``, never the 4,0 already typed."""
    q, k, v = (np.load(files / f"{n}.npy") for n in "qkv")
    wider = typed_keys(framework) + 1
    np.save(files / "out.npy", attention(q, k, v, causal=True, window=(wider, 0)).output)
    result = invoke("check", *given(framework), "--expect-output", "out.npy", "--format", "json")
    assert result.exit_code == ExitCode.CHECK_FAILED, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["cases"][0]["checks"]}
    hint = checks["output.close"]["hint"]
    assert hint.startswith("the export matches the computation with --window 5,0 (one key more")


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_frameworks_read_the_typed_window_each_in_its_terms(files: Path, framework: str) -> None:
    args = given(framework)
    result = invoke("compute", *args, "--frameworks", "--format", "json")
    assert result.exit_code == ExitCode.OK, result.output
    answers = json.loads(result.stdout)["frameworks"]["answers"]
    assert {a["as"]: a["window_keys"] for a in answers} == {
        name: [typed_keys(name), 0] for name in FRAMEWORKS
    }
    table = invoke("compute", *args, "--frameworks").stdout
    assert "--window 4,0 as typed, read in each framework's terms (hf's counts the" in table


def test_json_holds_the_options_as_typed_and_as_resolved(files: Path) -> None:
    doc = json.loads(invoke("compute", *given("hf"), "--format", "json").stdout)
    assert doc["options"]["window"] == [3, 0]
    assert doc["options"]["causal_align"] == "lower-right"
    assert doc["options_typed"] == {"framework": "hf", "causal": True, "window": [4, 0]}
