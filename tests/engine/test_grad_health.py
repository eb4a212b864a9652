"""Every gradient-health record's two readers agree, read from its entry
(``sdpa_cli.engine.grad_health``).

For each record of :data:`~sdpa_cli.engine.grad_health.GRAD_RECORDS`, the lean backward
block (the weights, top key and top weight from the online pass, dS formed over dA)
and the per-stage block give the same values on every mask option, finite mask values
included (exact for counts, keys and flags; to rounding for the rest), and the whole
pass keeps each in its place: a row's from its block, a key's merged over blocks.
A new record is tested here with no new code.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from attention_cases import CASES, make_spec
from numpy.typing import NDArray

from sdpa_cli.engine.block import key_range, operands
from sdpa_cli.engine.driver import Place, SliceInputs
from sdpa_cli.engine.grad import backward, check_fits, make_dout
from sdpa_cli.engine.grad_block import backward_block, lean_backward_block
from sdpa_cli.engine.grad_health import GRAD_RECORDS, GradRecord, record_bytes
from sdpa_cli.engine.spec import AttentionSpec

PROBLEMS = {
    **{name: case for name, case in CASES.items() if not case.get("float32")},
    "mask-value-1e9-padding": {"key_lengths": (0, 19), "mask_value": -1e9, "causal": True},
}


def blocks(spec: AttentionSpec, step: int) -> list[tuple[Any, Any]]:
    """The lean and per-stage blocks of every place of ``spec`` (the per-stage one twice
    where the lean block does not apply: a row that sees no key under a finite mask
    value)."""
    dout = make_dout(spec, "random", 5, "--dout")
    inputs_of = SliceInputs()
    pairs = []
    for index in np.ndindex(*spec.lead):
        lead = tuple(int(i) for i in index)
        for i0 in range(0, spec.L, step):
            rows = slice(i0, min(i0 + step, spec.L))
            place = Place(lead, rows, key_range(spec, lead, rows), inputs_of)
            inputs = operands(spec, lead, emulate=False)
            g = dout[place.at]
            want = backward_block(spec, lead, rows, g, keys=place.keys, inputs=inputs)
            got = lean_backward_block(spec, place, g, inputs, None) or want
            pairs.append((got, want))
    return pairs


def assert_agree(record: GradRecord, got: Any, want: Any, label: str) -> None:
    if np.issubdtype(record.dtype, np.floating):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13, err_msg=label)
    else:
        np.testing.assert_array_equal(got, want, err_msg=label)


@pytest.mark.parametrize("problem", PROBLEMS)
def test_the_lean_and_per_stage_blocks_agree_on_every_record(problem: str) -> None:
    spec = make_spec(3, **PROBLEMS[problem])
    pairs = blocks(spec, 5)
    assert any(got is not want for got, want in pairs), "the lean block computes some"
    for record in GRAD_RECORDS:
        for got, want in pairs:
            label = f"{problem}: {record.name} at {got.lead_index}, {got.rows}"
            assert list(got.health) == list(want.health) == [r.name for r in GRAD_RECORDS]
            values = got.health[record.name]
            assert values.dtype == np.dtype(record.dtype), label
            length = got.rows.stop - got.rows.start if record.axis == "row" else got.dk.shape[0]
            assert values.shape == (length,), label
            assert_agree(record, values, want.health[record.name], label)


def test_the_pass_keeps_each_record_in_its_place() -> None:
    """A row's record is its block's; a key's is merged over the blocks of rows."""
    spec = make_spec(4, **CASES["causal-window-padding"])
    dout = make_dout(spec, "random", 6, "--dout")
    whole = backward(spec, dout, rows=4)
    assert list(whole.health) == [r.name for r in GRAD_RECORDS]
    for index in np.ndindex(*spec.lead):
        lead = tuple(int(i) for i in index)
        merged: dict[str, NDArray[Any]] = {}
        for i0 in range(0, spec.L, 4):
            rows = slice(i0, min(i0 + 4, spec.L))
            block = backward_block(spec, lead, rows, dout[lead][rows])  # every key
            for record in GRAD_RECORDS:
                values = block.health[record.name]
                if record.merge is None:
                    assert_agree(record, whole.health[record.name][lead][rows], values, record.name)
                elif record.name not in merged:
                    merged[record.name] = values.copy()
                else:
                    record.merge(merged[record.name], values)
        for name, values in merged.items():
            record = next(r for r in GRAD_RECORDS if r.name == name)
            assert_agree(record, whole.health[name][lead], values, name)


def test_the_memory_check_counts_every_record() -> None:
    spec = make_spec(5)
    rows, keys = 2 * 2 * spec.L, 2 * 2 * spec.S
    assert record_bytes(rows, keys) == sum(
        np.dtype(r.dtype).itemsize * (rows if r.axis == "row" else keys) for r in GRAD_RECORDS
    )
    check_fits(spec)  # a few kilobytes: fits
