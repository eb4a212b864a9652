"""The plain computation in the export's format, for the rows the rule needs it in.

:func:`~sdpa_cli.check.plain.plain_values` runs the per-stage path (every stage
rounded to the format) through the block driver, on threads: what it gives is each
needed row block's emulated output and LSE, whatever the threads, and NaN elsewhere.
"""

from __future__ import annotations

import numpy as np

from sdpa_cli.check.exports import as_naive, fit_expected
from sdpa_cli.check.plain import plain_values
from sdpa_cli.check.records import Expected
from sdpa_cli.engine.block import attend_block, block_lse
from sdpa_cli.engine.driver import block_rows
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import build_spec


def test_the_plain_computation_is_the_emulated_blocks_of_the_needed_rows_on_any_threads() -> None:
    rng = np.random.default_rng(2)
    q, k, v = (rng.normal(size=(2, 3, 40, 8)).astype(np.float16) for _ in range(3))
    spec = build_spec(q, k, v, options=Options(causal=True))
    naive = as_naive(spec, "float16")
    exports = {
        "output": fit_expected(spec, Expected("output", np.zeros((2, 3, 40, 8)), "out.npy")),
        "lse": fit_expected(spec, Expected("lse", np.zeros((2, 3, 40)), "lse.npy")),
    }
    need = np.zeros((2, 3, 40), dtype=np.bool_)
    need[0, 1, 3] = need[1, 2, 39] = True  # two slices, one row each

    one = plain_values(naive, exports, need, jobs=1)
    two = plain_values(naive, exports, need, jobs=2)
    for name in ("output", "lse"):
        np.testing.assert_array_equal(one[name], two[name])

    step = block_rows(naive)
    output, lse = one["output"], one["lse"]
    assert output is not None
    assert lse is not None
    for (b, h), row in (((0, 1), 3), ((1, 2), 39)):
        i0 = row // step * step
        rows = slice(i0, min(i0 + step, 40))
        block = attend_block(naive, (b, h), rows, emulate=True)
        np.testing.assert_array_equal(output[b, h, rows], block.output.astype(np.float32))
        np.testing.assert_array_equal(lse[b, h, rows], block_lse(block))
    computed = ~np.isnan(lse)
    assert computed[0, 1].any()
    assert computed[1, 2].any()
    computed[0, 1] = computed[1, 2] = False
    assert not computed.any()  # the other slices: not computed
