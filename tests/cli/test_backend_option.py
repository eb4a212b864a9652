"""``--backend`` and ``--device`` on the command line and in the config file: what
computes a command's blocks, said in its JSON, and one clear line for a bad value."""

from __future__ import annotations

from pathlib import Path

import pytest
from clirunner import assert_one_error_line, invoke, strict_json

from sdpa_cli.engine.arrays import NUMPY, current

QKV = [f"samples/check/{n}.npy" for n in "qkv"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def inputs() -> list[str]:
    return [str(ROOT / p) for p in QKV]


def backend_of(*args: str) -> tuple[str, str]:
    result = invoke("check", *args, "--format", "json")
    assert result.exit_code == 0, result.stderr
    case = strict_json(result.stdout)["cases"][0]
    return case["backend"], case["device"]


def test_numpy_computes_by_default_and_torch_when_asked(workdir: Path, inputs: list[str]) -> None:
    assert backend_of(*inputs, "--causal") == ("numpy", "cpu")
    pytest.importorskip("torch")
    assert backend_of(*inputs, "--causal", "--backend", "torch") == ("torch", "cpu")
    assert current() == NUMPY  # the command's choice ended with it


def test_the_config_file_chooses_the_backend_and_a_flag_wins(
    workdir: Path, inputs: list[str]
) -> None:
    pytest.importorskip("torch")
    (workdir / "sdpa.yaml").write_text("backend: torch\nsaturation: 0.99\n")
    assert backend_of(*inputs) == ("torch", "cpu")
    assert backend_of(*inputs, "--backend", "numpy") == ("numpy", "cpu")


@pytest.mark.parametrize(
    ("config", "flags", "message"),
    [
        (
            "",
            ["--backend", "numpy", "--device", "cuda:1"],
            "--device: 'cuda:1' needs --backend torch",
        ),
        ("backend: jax\n", [], "sdpa.yaml: backend: expected one of auto, numpy, torch, got 'jax'"),
        ("backend: [torch]\n", [], "sdpa.yaml: backend: expected text, got list"),
        ("device: 7\n", [], "sdpa.yaml: device: expected text, got int"),
    ],
)
def test_a_bad_backend_or_device_is_one_line(
    workdir: Path, inputs: list[str], config: str, flags: list[str], message: str
) -> None:
    if config:
        (workdir / "sdpa.yaml").write_text(config)
    line = assert_one_error_line(invoke("check", *inputs, *flags))
    assert line.startswith("sdpa: error: " + message), line


def test_a_document_names_what_computed_it_not_what_was_asked(workdir: Path) -> None:
    """grad's backward pass runs on numpy, and a float mask takes the per-stage path:
    their documents say numpy under --backend torch; compute's findings, torch."""
    pytest.importorskip("torch")
    runs = {
        ("compute", "sample:causal.yaml"): "torch",
        ("compute", "sample:float_mask.yaml"): "numpy",
        ("grad", "sample:causal.yaml", "--dout", "random"): "numpy",
    }
    for args, computed in runs.items():
        result = invoke(*args, "--backend", "torch", "--format", "json")
        assert result.exit_code == 0, result.stderr
        doc = strict_json(result.stdout)
        assert (doc["backend"], doc["device"]) == (computed, "cpu"), args
