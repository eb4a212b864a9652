"""Gradient health read a chunk at a time: the same figures as the whole tensor at once."""

from __future__ import annotations

import numpy as np
import pytest
from attention_cases import make_spec

from sdpa_cli.diagnosis import grad as health
from sdpa_cli.diagnosis.findings import Thresholds
from sdpa_cli.engine.grad import backward, make_dout


def test_ranges_and_non_finite_values_read_in_chunks_equal_one_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = make_spec(2, causal=True, spread=30.0)
    grads = backward(spec, make_dout(spec, "random", 3, "--dout"))
    grads.dk[1, 0, 4, 2] = np.nan  # one non-finite value, found by its chunk
    grads.dv[0, 1, 3, 1] = 1e6  # beyond float16
    grads.dq[0, 0, 2, 0] = 1e-9  # subnormal in float16
    whole = health.diagnose_grad(grads, Thresholds(), "float16")
    monkeypatch.setattr(health, "CHUNK", 7)  # chunks that cut rows and slices
    chunked = health.diagnose_grad(grads, Thresholds(), "float16")
    assert chunked.ranges == whole.ranges
    assert [f.to_dict() for f in chunked.findings] == [f.to_dict() for f in whole.findings]
    kinds = {(f.kind, f.stage) for f in whole.findings}
    assert ("gradient_nonfinite", "dk") in kinds
    assert ("gradient_range", "dv") in kinds
    overflow = [r for r in whole.ranges if (r.name, r.dtype) == ("dv", "float16")]
    assert overflow[0].overflow == 1
