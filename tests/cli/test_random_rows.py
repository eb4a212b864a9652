"""Random attention under a causal mask through compute, explain and check: no finding,
where every run used to say its second query's row, over 2 keys, was near uniform and
blamed the scale; the scale applied twice is still told."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from clirunner import invoke

from sdpa_cli.errors import ExitCode


def write_random(d: Path, seed: int, dtype: str, *, causal: bool = True) -> None:
    """Q, K, V of unit normals (B = 2, H = 4, L = S = 128, E = 64) and their output by
    the formula in float64, causal, rounded to ``dtype`` (what a kernel exports)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((2, 4, 128, 64)).astype(dtype) for _ in range(3))
    for name, a in {"q": q, "k": k, "v": v}.items():
        np.save(d / f"{name}.npy", a)
    s = np.einsum("BHLE,BHSE->BHLS", q.astype(np.float64), k.astype(np.float64)) / math.sqrt(64)
    if causal:
        s = np.where(np.tril(np.ones((128, 128), dtype=bool)), s, -np.inf)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    np.save(d / "out.npy", np.einsum("BHLS,BHSE->BHLE", w, v.astype(np.float64)).astype(dtype))


COMMANDS = {
    "compute": ("compute", "--stages", "output"),
    "explain": ("explain",),
    "check": ("check", "--expect-output", "out.npy"),
}


def finding_counts(command: str, *options: str) -> dict[str, int]:
    result = invoke(*COMMANDS[command], "q.npy", "k.npy", "v.npy", *options, "--format", "json")
    assert result.exit_code == ExitCode.OK, result.output
    doc = json.loads(result.stdout)
    counts: dict[str, int] = (doc["cases"][0] if command == "check" else doc)["finding_counts"]
    return counts


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("seed", "dtype"), [(0, "float32"), (3, "float32"), (1, "float16")])
def test_random_causal_attention_raises_no_finding(
    workdir: Path, command: str, seed: int, dtype: str
) -> None:
    """Seed 0 drew near-uniform rows over 2 keys ([0, 2, 1], [1, 1, 1]); seed 3 a
    one-hot one ([1, 2, 1]: 0.9939 on key 1 of 2)."""
    write_random(workdir, seed, dtype)
    assert finding_counts(command, "--causal") == {}


@pytest.mark.parametrize("command", COMMANDS)
def test_random_attention_without_a_mask_raises_no_finding(workdir: Path, command: str) -> None:
    write_random(workdir, 0, "float32", causal=False)
    assert finding_counts(command) == {}


def test_the_scale_applied_twice_is_still_told(workdir: Path) -> None:
    """--scale dk: logits of std 1/8; rows over a few keys are as flat as random rows
    often are and go unflagged; 975 of the 8 × 127 rows over 2 keys or more are near
    uniform, and every head is dead."""
    write_random(workdir, 0, "float32")
    counts = finding_counts("compute", "--stages", "output", "--causal", "--scale", "dk")
    assert counts == {"unscaled": 1, "dead_head": 8, "near_uniform": 975}
