"""The engine's start: BLAS's threads, whatever was imported first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sdpa_cli.cli.run import BLAS_THREADS

pytest.importorskip("threadpoolctl")

# numpy loaded before the engine starts, as reading a config file or an input does
SCRIPT = """
import json, numpy, threadpoolctl
from sdpa_cli.cli.options import Computing
from sdpa_cli.cli.run import start_engine

def blas():
    return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]

before = blas()
start_engine(Computing(jobs=2))
print(json.dumps({"before": before, "after": blas()}))
"""


def blas_threads(**env: str) -> dict[str, list[int]]:
    clean = {k: v for k, v in os.environ.items() if k not in BLAS_THREADS}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**clean, **env}, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    found: dict[str, list[int]] = json.loads(run.stdout)
    if not found["before"]:
        pytest.skip("numpy's BLAS is not one threadpoolctl knows")
    return found


def test_blas_gets_one_thread_per_engine_thread_when_numpy_is_loaded_first() -> None:
    found = blas_threads()
    if max(found["before"]) == 1:
        pytest.skip("one core: BLAS starts with one thread")
    assert found["after"] == [1] * len(found["after"])


def test_a_blas_thread_count_the_user_set_wins() -> None:
    found = blas_threads(OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")
    assert found["after"] == found["before"]
    assert max(found["after"]) == 2


TORCH_SCRIPT = """
import torch
from sdpa_cli.cli.options import Computing
from sdpa_cli.cli.run import start_engine

print(start_engine(Computing(jobs=3, backend="torch")), torch.get_num_threads())
"""


def test_torch_computes_on_the_engines_threads_not_the_one_blas_is_given() -> None:
    """Regression: OMP_NUM_THREADS=1, set for numpy's BLAS, left torch on one core."""
    pytest.importorskip("torch")
    clean = {k: v for k, v in os.environ.items() if k not in BLAS_THREADS}
    run = subprocess.run(
        [sys.executable, "-c", TORCH_SCRIPT], env=clean, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    threads, torch_threads = run.stdout.split()
    assert torch_threads == threads == "3"
