"""The backward pass (``sdpa_cli.engine.grad``): dQ, dK, dV and d(bias) of ℓ = Σ O ⊙ dO.

Four witnesses, each able to catch what the others miss:

1. PyTorch autograd in float64 — ``scaled_dot_product_attention`` itself where it
   has the option, a plain torch graph otherwise (``grad_reference``) — on every
   option of :class:`~sdpa_cli.engine.spec.Options`; skipped where torch is absent.
2. Central finite differences (``numeric_check``), which need no torch; and a
   corrupted gradient, to show the check can fail.
3. The engine against itself: any blocking and any number of threads give the same
   gradients (bit-identical across threads), through one block or all of them.
4. Properties (hypothesis) and the health records: rows of d(logits) sum to zero, a
   constant added to V changes no logit gradient, V's gradient sums to dO's, keys
   permute, ‖dS‖ ≤ (1 − Σ A²) ‖dA‖, a saturated row passes nothing back.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from attention_cases import CASES as MASK_CASES
from attention_cases import make_spec
from grad_reference import (
    F64,
    Reference,
    causal_visible,
    graph_reference,
    padding_visible,
    sdpa_reference,
    torch_gradients,
    torch_graph,
    torch_sdpa,
    window_visible,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from numpy.typing import NDArray

from sdpa_cli.engine import masks
from sdpa_cli.engine.block import dropout_keep, key_range
from sdpa_cli.engine.grad import Gradients, backward, make_dout
from sdpa_cli.engine.grad_block import backward_block
from sdpa_cli.engine.numeric import numeric_check
from sdpa_cli.engine.options import FINFO_MIN, Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError

RTOL = 1e-10
ATOL = 1e-12
"""Against torch: both are float64 and differ only in the order of their sums."""
NUMERIC_TOLERANCE = 1e-6
"""Central differences at h ≈ 6·10⁻⁶ are good to ~10⁻⁹ relative on these problems."""
BOUNDED = settings(max_examples=25, deadline=None)
VALUES = st.floats(-3, 3, allow_nan=False, allow_infinity=False)


def normal(seed: int, *shape: int) -> F64:
    return np.random.default_rng(seed).normal(size=shape)


@pytest.fixture
def torch() -> Any:
    """PyTorch, or a skip: it is a reference for the tests only, never a dependency."""
    return pytest.importorskip("torch")


# --- the cases: inputs, options and a torch reference for each ----------------------------


@dataclass(frozen=True)
class Case:
    """Inputs as loaded, options, and the torch graph (or SDPA call) computing the same."""

    name: str
    q: F64
    k: F64
    v: F64
    reference: Reference
    bias: F64 | None = None
    mask: NDArray[Any] | None = None
    options: Options = field(default_factory=Options)

    @property
    def spec(self) -> AttentionSpec:
        return build_spec(
            self.q, self.k, self.v, bias=self.bias, mask=self.mask, options=self.options
        )

    @property
    def arrays(self) -> dict[str, F64]:
        named = {"q": self.q, "k": self.k, "v": self.v}
        return named if self.bias is None else {**named, "bias": self.bias}

    def gradients(self, seed: int = 11, **kwargs: Any) -> Gradients:
        spec = self.spec
        return backward(spec, make_dout(spec, "random", seed, "--dout"), **kwargs)


B, H, L, S, E, EV = 2, 3, 4, 6, 8, 5


def qkv(
    L: int = L,
    S: int = S,
    q_lead: tuple[int, ...] = (B, H),
    kv_lead: tuple[int, ...] = (B, H),
    seed: int = 0,
) -> tuple[F64, F64, F64]:
    return (
        normal(seed, *q_lead, L, E),
        normal(seed + 1, *kv_lead, S, E),
        normal(seed + 2, *kv_lead, S, EV),
    )


def alibi_bias(heads: int, L: int, S: int) -> F64:
    """(heads, L, S): ALiBi's bias from ``sdpa_cli.engine.masks``, to hand torch as a float mask."""
    slopes = masks.alibi_slopes(heads)
    return np.stack([masks.alibi(0, L, L, S, float(s)) for s in slopes])


def keep_mask(spec: AttentionSpec) -> NDArray[np.bool_]:
    """The dropout keep-mask of every slice, whole: (*lead, L, S)."""
    whole = np.zeros(spec.weights_shape, dtype=np.bool_)
    for lead in np.ndindex(*spec.lead):
        li = tuple(int(i) for i in lead)
        whole[li] = dropout_keep(spec, li, slice(0, spec.L), slice(0, spec.S))
    return whole


def split(torch: Any, x: Any, heads: int) -> Any:
    """(B, L, heads·D) → (B, heads, L, D), as ``Options(heads=...)`` splits."""
    b, n, d = x.shape
    return x.reshape(b, n, heads, d // heads).transpose(1, 2)


def build_cases() -> list[Case]:
    cases: list[Case] = []
    add = cases.append
    q, k, v = qkv()

    # Scale and temperature: SDPA's scale= is the factor on Q Kᵀ.
    add(Case("default-scale", q, k, v, lambda torch, t: torch_sdpa(torch, t)))
    for rule, factor in (("dk", 1 / E), ("none", 1.0), (0.3, 0.3)):
        add(
            Case(
                f"scale-{rule}",
                q,
                k,
                v,
                sdpa_reference(scale=factor),
                options=Options(scale=rule),
            )
        )
    add(
        Case(
            "temperature",
            q,
            k,
            v,
            lambda torch, t: torch_sdpa(torch, t, scale=0.5 / 2.5),
            options=Options(scale=0.5, temperature=2.5),
        )
    )
    add(
        Case(
            "prescale",
            q,
            k,
            v,
            lambda torch, t: torch_sdpa(torch, t, scale=0.7),
            options=Options(scale=0.7, prescale=True),
        )
    )

    # Softcap: no SDPA argument; a graph (scale none, so that tanh bends).
    add(
        Case(
            "softcap",
            q,
            k,
            v,
            lambda torch, t: torch_graph(torch, t, factor=1.0, softcap=2.0),
            options=Options(scale="none", softcap=2.0),
        )
    )

    # Biases: SDPA adds a float attn_mask and differentiates it, summing over broadcast axes.
    for label, shape in (
        ("full", (B, H, L, S)),
        ("L-S", (L, S)),
        ("keys-only", (1, 1, 1, S)),
        ("rows-only", (L, 1)),
        ("per-batch", (B, 1, L, S)),
    ):
        add(
            Case(
                f"bias-{label}",
                q,
                k,
                v,
                lambda torch, t: torch_sdpa(torch, t, attn_mask=t["bias"]),
                bias=normal(20, *shape),
            )
        )

    # ALiBi (3 heads: the paper's rule for a count that is not a power of two), L ≠ S,
    # with a bias beside it.
    qa, ka, va = qkv(3, 7)
    alibi = alibi_bias(H, 3, 7)
    add(
        Case(
            "alibi",
            qa,
            ka,
            va,
            lambda torch, t: torch_sdpa(torch, t, attn_mask=t["bias"] + torch.from_numpy(alibi)),
            bias=normal(21, 3, 7),
            options=Options(alibi=True),
        )
    )

    # Causal, both alignments, L < S and L > S (lower-right with L > S hides whole rows).
    for Lc, Sc in ((3, 6), (6, 3)):
        qc, kc, vc = qkv(Lc, Sc)
        add(
            Case(
                f"causal-upper-left-{Lc}x{Sc}",
                qc,
                kc,
                vc,
                lambda torch, t: torch_sdpa(torch, t, is_causal=True),
                options=Options(causal=True),
            )
        )
        add(
            Case(
                f"causal-lower-right-{Lc}x{Sc}",
                qc,
                kc,
                vc,
                sdpa_reference(causal_visible(Lc, Sc, "lower-right")),
                options=Options(causal=True, causal_align="lower-right"),
            )
        )

    # Boolean masks, both meanings of True; one row hidden entirely.
    allowed = np.random.default_rng(22).random((B, 1, L, S)) > 0.35
    allowed[1, 0, 2] = False
    add(
        Case(
            "bool-mask-attend",
            q,
            k,
            v,
            lambda torch, t: torch_sdpa(torch, t, attn_mask=allowed),
            mask=allowed,
        )
    )
    add(
        Case(
            "bool-mask-masked",
            q,
            k,
            v,
            lambda torch, t: torch_sdpa(torch, t, attn_mask=allowed),
            mask=~allowed,
            options=Options(mask_true_means="masked"),
        )
    )

    # A float mask is added: −1e9 entries, finite ones (and key 0 finite in every row).
    additive = normal(23, B, 1, L, S) * 2
    additive[np.random.default_rng(24).random(additive.shape) < 0.3] = -1e9
    additive[..., 0] = 0.5
    add(
        Case(
            "float-mask",
            q,
            k,
            v,
            lambda torch, t: torch_sdpa(torch, t, attn_mask=additive),
            mask=additive,
        )
    )
    # ... and −inf entries, one row −inf throughout (no visible key: zeros).
    hiding = normal(25, L, S)
    hiding[np.random.default_rng(26).random(hiding.shape) < 0.3] = -math.inf
    hiding[1] = -math.inf
    hiding[0, 0] = 0.0
    add(
        Case(
            "float-mask-inf",
            q,
            k,
            v,
            lambda torch, t: torch_sdpa(torch, t, attn_mask=hiding),
            mask=hiding,
        )
    )

    # Key padding, per batch item.
    add(
        Case(
            "key-lengths",
            q,
            k,
            v,
            lambda torch, t: torch_sdpa(torch, t, attn_mask=padding_visible((6, 2), L, S)),
            options=Options(key_lengths=(6, 2)),
        )
    )

    # Windows: W, LEFT,RIGHT lower-right with L < S, and one that leaves rows empty.
    for (Lw, Sw), window, align in (
        ((6, 6), (1, 1), "upper-left"),
        ((4, 7), (2, 0), "lower-right"),
        ((6, 4), (0, 2), "upper-left"),
    ):
        qw, kw, vw = qkv(Lw, Sw)
        add(
            Case(
                f"window-{window[0]},{window[1]}-{align}-{Lw}x{Sw}",
                qw,
                kw,
                vw,
                sdpa_reference(window_visible(Lw, Sw, *window, align)),
                options=Options(window=window, causal_align=align),
            )
        )

    # A finite mask value replaces the hidden logits: a row with no visible key is
    # uniform, and masked_fill passes no gradient to what it replaced.
    for label, value in (("-1e9", -1e9), ("finfo-min", FINFO_MIN)):
        add(
            Case(
                f"mask-value-{label}-padding",
                q,
                k,
                v,
                graph_reference(
                    factor=1 / math.sqrt(E), visible=padding_visible((0, 4), L, S), mask_value=value
                ),
                options=Options(key_lengths=(0, 4), mask_value=value),
            )
        )
    qm, km, vm = qkv(6, 3)
    add(
        Case(
            "mask-value-1e9-causal-lower-right-6x3",
            qm,
            km,
            vm,
            lambda torch, t: torch_graph(
                torch,
                t,
                factor=1 / math.sqrt(E),
                visible=causal_visible(6, 3, "lower-right"),
                mask_value=-1e9,
            ),
            options=Options(causal=True, causal_align="lower-right", mask_value=-1e9),
        )
    )

    # Dropout: the engine's keep-mask, applied after the softmax in a torch graph.
    qd, kd, vd = qkv(5, 7)
    dropout = Options(dropout=0.3, seed=5, causal=True)
    keep = keep_mask(build_spec(qd, kd, vd, options=dropout))
    assert 0 < keep.mean() < 1
    add(
        Case(
            "dropout-causal",
            qd,
            kd,
            vd,
            lambda torch, t: torch_graph(
                torch,
                t,
                factor=1 / math.sqrt(E),
                visible=causal_visible(5, 7),
                keep=keep,
                dropout=0.3,
            ),
            options=dropout,
        )
    )

    # Heads: GQA, MQA, Q with one head over K/V's, K/V broadcast over the batch.
    qg, kg, vg = qkv(q_lead=(B, 8), kv_lead=(B, 2))
    add(
        Case(
            "gqa-8-over-2-causal",
            qg,
            kg,
            vg,
            lambda torch, t: torch_sdpa(torch, t, is_causal=True, enable_gqa=True),
            options=Options(causal=True),
        )
    )
    qg, kg, vg = qkv(q_lead=(B, 4), kv_lead=(B, 1))
    add(Case("mqa", qg, kg, vg, lambda torch, t: torch_sdpa(torch, t, enable_gqa=True)))
    qg, kg, vg = qkv(q_lead=(B, 1), kv_lead=(B, 4))
    add(Case("q-one-head", qg, kg, vg, lambda torch, t: torch_sdpa(torch, t)))
    qg, kg, vg = qkv(q_lead=(3, 2), kv_lead=(1, 2))
    add(Case("kv-batch-broadcast", qg, kg, vg, lambda torch, t: torch_sdpa(torch, t)))
    # Several at once through the graph: GQA, softcap, a bias, a causal mask, dropout.
    qg, kg, vg = qkv(5, 7, q_lead=(B, 4), kv_lead=(B, 2))
    mixed = Options(causal=True, softcap=1.5, dropout=0.2, seed=9)
    keep_g = keep_mask(build_spec(qg, kg, vg, options=mixed))
    add(
        Case(
            "gqa-softcap-bias-causal-dropout",
            qg,
            kg,
            vg,
            lambda torch, t: torch_graph(
                torch,
                t,
                factor=1 / math.sqrt(E),
                softcap=1.5,
                group=2,
                visible=causal_visible(5, 7),
                keep=keep_g,
                dropout=0.2,
            ),
            bias=normal(27, 4, 5, 7),
            options=mixed,
        )
    )

    # Heads split from the last axis: (B, L, N·E) in, gradients as loaded.
    qh, kh, vh = normal(30, B, L, 2 * E), normal(31, B, S, 2 * E), normal(32, B, S, 2 * EV)
    add(
        Case(
            "heads-2",
            qh,
            kh,
            vh,
            lambda torch, t: torch_sdpa(torch, {n: split(torch, x, 2) for n, x in t.items()}),
            options=Options(heads=2),
        )
    )

    # Cross-attention (L ≠ S, causal-free) and a single 1-D query.
    qx, kx, vx = qkv(3, 9)
    add(Case("cross-3x9", qx, kx, vx, lambda torch, t: torch_sdpa(torch, t)))
    add(
        Case(
            "one-query-1d",
            normal(40, E),
            normal(41, S, E),
            normal(42, S, EV),
            lambda torch, t: torch_sdpa(torch, {**t, "q": t["q"][None]}),
        )
    )
    return cases


CASES = build_cases()
CASE_IDS = [c.name for c in CASES]


# --- 1. against PyTorch autograd ----------------------------------------------------------


def assert_gradients_equal(grads: Gradients, want: dict[str, F64]) -> None:
    """Every gradient sdpa has, torch has, in the shape its operand was loaded in."""
    assert set(grads.present()) == set(want)
    for name, expected in want.items():
        got = grads.loaded(name)
        assert got is not None
        assert got.shape == expected.shape, name
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_match_torch_autograd(case: Case, torch: Any) -> None:
    grads = case.gradients()
    want = torch_gradients(torch, case.reference, case.arrays, grads.dout)
    assert_gradients_equal(grads, want)
    # Not trivially zero: every tensor carries a gradient somewhere (but a bias that is
    # constant along the keys, which softmax cannot see: test_a_row_bias_gets_no_gradient).
    for name, w in want.items():
        if name != "dbias" or w.shape[-1] > 1:
            assert np.abs(w).max() > 1e-3, name


def test_a_row_bias_gets_no_gradient() -> None:
    """A bias (L, 1) shifts whole rows of logits, which softmax ignores: d(bias) is
    Σ_j dS_ij = 0, to rounding."""
    case = next(c for c in CASES if c.name == "bias-rows-only")
    dbias = case.gradients().loaded("dbias")
    assert dbias is not None
    assert dbias.shape == (L, 1)
    assert np.all(np.abs(dbias) < 1e-14)


def test_graph_reference_matches_torch_sdpa(torch: Any) -> None:
    """The hand-written graph (softcap, dropout, mask values) is itself PyTorch's SDPA
    where both apply: a bias, a causal mask with a fully hidden row, GQA."""
    q, k, v = qkv(6, 3, q_lead=(B, 4), kv_lead=(B, 2))
    bias = normal(50, 6, 3)
    dout = normal(51, B, 4, 6, EV)
    visible = causal_visible(6, 3, "lower-right")
    arrays_ = {"q": q, "k": k, "v": v, "bias": bias}
    graph = torch_gradients(
        torch,
        lambda torch, t: torch_graph(torch, t, factor=0.4, group=2, visible=visible),
        arrays_,
        dout,
    )
    sdpa = torch_gradients(
        torch,
        lambda torch, t: torch_sdpa(
            torch,
            {**t, "bias": None},
            attn_mask=t["bias"].masked_fill(~torch.from_numpy(visible), -math.inf),
            scale=0.4,
            enable_gqa=True,
        ),
        arrays_,
        dout,
    )
    for name in graph:
        np.testing.assert_allclose(graph[name], sdpa[name], rtol=RTOL, atol=ATOL, err_msg=name)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn"])
def test_the_backward_pass_is_float64_whatever_the_dtype(dtype: str) -> None:
    """--dtype (and its working formats) emulate the forward kernel; the gradients are
    exact float64 all the same: equal to the bit to those of a float64 run."""
    case = next(c for c in CASES if c.name == "gqa-softcap-bias-causal-dropout")
    want = case.gradients()
    formats = Options(
        dtype=dtype, accumulate="float32", softmax_dtype="float32", logits_dtype="float32"
    )
    options = dataclasses.replace(
        case.options,
        dtype=formats.dtype,
        accumulate=formats.accumulate,
        softmax_dtype=formats.softmax_dtype,
        logits_dtype=formats.logits_dtype,
    )
    got = dataclasses.replace(case, options=options).gradients()
    for name in ("dq", "dk", "dv", "dbias"):
        np.testing.assert_array_equal(got.tensor(name), want.tensor(name), err_msg=name)
    np.testing.assert_array_equal(got.ds_norm, want.ds_norm)


# --- 2. central finite differences (no torch) ---------------------------------------------


NUMERIC_CASES = [pytest.param(c, id=c.name) for c in CASES]


@pytest.mark.parametrize("case", NUMERIC_CASES)
def test_numeric_check_agrees_with_the_analytic_gradients(case: Case) -> None:
    grads = case.gradients()
    checks = numeric_check(grads, 20, seed=3)
    assert [c.name for c in checks] == list(grads.present())
    for check in checks:
        loaded = grads.loaded(check.name)
        assert loaded is not None
        assert check.samples == min(20, loaded.size)
        assert check.passed(NUMERIC_TOLERANCE), check
        assert check.max_rel_error < NUMERIC_TOLERANCE
        assert check.worst_at is not None
        assert len(check.worst_at) == loaded.ndim
        assert loaded[check.worst_at] == check.analytic
        assert check.numeric == pytest.approx(check.analytic, rel=1e-6, abs=1e-9)


def test_numeric_check_catches_a_gradient_one_percent_off() -> None:
    """dQ scaled by 1.01: every sampled entry is off by 0.01/1.01 relative, dK and dV are
    not, and the worst entry is named by its index in Q as loaded (heads merged)."""
    case = next(c for c in CASES if c.name == "heads-2")
    grads = case.gradients()
    wrong = dataclasses.replace(grads, dq=grads.dq * 1.01)
    checks = {c.name: c for c in numeric_check(wrong, 20, seed=4)}
    dq = checks["dq"]
    assert dq.max_rel_error == pytest.approx(0.01 / 1.01, rel=1e-5)
    assert not dq.passed(NUMERIC_TOLERANCE)
    assert dq.passed(0.02)
    assert dq.worst_at is not None
    true_dq = grads.loaded("dq")
    assert true_dq is not None
    assert true_dq.shape == case.q.shape
    assert dq.analytic == pytest.approx(1.01 * true_dq[dq.worst_at], rel=1e-14)
    assert dq.numeric == pytest.approx(true_dq[dq.worst_at], rel=1e-7)
    assert checks["dk"].passed(NUMERIC_TOLERANCE)
    assert checks["dv"].passed(NUMERIC_TOLERANCE)


def test_numeric_check_catches_a_dbias_on_the_wrong_keys() -> None:
    """A (1, 1, 1, S) bias's gradient, its keys reversed, fails (and only 20 are drawn)."""
    case = next(c for c in CASES if c.name == "bias-keys-only")
    grads = case.gradients()
    assert grads.dbias is not None
    wrong = dataclasses.replace(grads, dbias=grads.dbias[..., ::-1])
    (check,) = numeric_check(wrong, 20, seed=4, names=("dbias",))
    assert check.name == "dbias"
    assert check.samples == S
    assert check.max_rel_error > 0.01
    assert not check.passed(NUMERIC_TOLERANCE)


# --- 3. blocking, threads, one block --------------------------------------------------------


def blocking_specs() -> dict[str, AttentionSpec]:
    q, k, v = normal(60, 1, 2, 70, 8), normal(61, 1, 2, 33, 8), normal(62, 1, 2, 33, 4)
    causal = build_spec(q, k, v, bias=normal(63, 1, 33), options=Options(causal=True))
    qg, kg, vg = normal(64, 2, 4, 23, 6), normal(65, 2, 2, 30, 6), normal(66, 2, 2, 30, 3)
    many = build_spec(
        qg,
        kg,
        vg,
        bias=normal(67, 23, 1),
        options=Options(
            causal=True,
            causal_align="lower-right",
            window=(9, 0),
            key_lengths=(30, 17),
            dropout=0.25,
            seed=3,
            softcap=4.0,
        ),
    )
    return {"causal-1x2x70x33": causal, "gqa-window-padding-dropout": many}


BLOCKING_SPECS = blocking_specs()


def records(grads: Gradients) -> dict[str, NDArray[Any]]:
    names: tuple[str, ...] = ("dq", "dk", "dv", "dbias", "da_norm", "ds_norm", "gain")
    names += ("max_weight", "argmax", "n_visible", "key_weight", "key_seen")
    return {n: getattr(grads, n) for n in names}


@pytest.mark.parametrize("name", BLOCKING_SPECS)
def test_any_blocking_and_thread_count_give_the_same_gradients(name: str) -> None:
    spec = BLOCKING_SPECS[name]
    # The test is only worth its time if some block skips keys.
    assert key_range(spec, (0, 0), slice(0, 3)) != slice(0, spec.S)
    dout = make_dout(spec, "random", 1, "--dout")
    want = records(backward(spec, dout))
    for rows in (1, 3, None):
        runs = [records(backward(spec, dout, rows=rows, jobs=jobs)) for jobs in (1, 3)]
        for field_name, expected in want.items():
            for run in runs:
                got = run[field_name]
                if got.dtype.kind == "f":
                    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
                else:
                    np.testing.assert_array_equal(got, expected)
            # Threads change nothing, to the bit: sums run in block order.
            np.testing.assert_array_equal(runs[0][field_name], runs[1][field_name])


def test_argmax_of_a_row_without_keys_does_not_depend_on_blocking() -> None:
    spec = BLOCKING_SPECS["gqa-window-padding-dropout"]
    dout = make_dout(spec, "random", 1, "--dout")
    whole, one_row = backward(spec, dout), backward(spec, dout, rows=1)
    empty = whole.n_visible == 0
    assert empty.any()
    np.testing.assert_array_equal(one_row.argmax[empty], whole.argmax[empty])


def test_backward_block_is_one_block_of_backward() -> None:
    """Rows 0..3 through one block: their dQ rows, and K/V gradients for only the keys
    the block computes; the blocks of a slice add up to the whole."""
    spec = BLOCKING_SPECS["causal-1x2x70x33"]
    dout = make_dout(spec, "random", 2, "--dout")
    whole = backward(spec, dout)
    lead = (0, 1)
    dk = np.zeros((spec.S, spec.E))
    dv = np.zeros((spec.S, spec.Ev))
    for i0 in range(0, spec.L, 9):
        rows = slice(i0, min(i0 + 9, spec.L))
        keys = key_range(spec, lead, rows)
        block = backward_block(spec, lead, rows, dout[lead][rows], keys=keys)
        assert block.dk.shape == (keys.stop - keys.start, spec.E)
        np.testing.assert_allclose(block.dq, whole.dq[lead][rows], rtol=1e-12, atol=1e-14)
        np.testing.assert_array_equal(block.n_visible, whole.n_visible[lead][rows])
        dk[keys] += block.dk
        dv[keys] += block.dv
    np.testing.assert_allclose(dk, whole.dk[lead], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dv, whole.dv[lead], rtol=1e-12, atol=1e-14)
    # First block (rows 0..8) sees keys 0..8 alone under the causal mask.
    first = backward_block(spec, lead, slice(0, 9), dout[lead][:9], keys=slice(0, 9))
    everything = backward_block(spec, lead, slice(0, 9), dout[lead][:9])
    np.testing.assert_allclose(first.dq, everything.dq, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(first.dk, everything.dk[:9], rtol=1e-12, atol=1e-14)
    assert np.all(everything.dk[9:] == 0.0)


# --- 4. properties ------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """Q (B, H, L, E), K (B, H, S, E), V (B, H, S, Ev), dO, a full-shape bias, a
    boolean mask (B, 1, L, S) and options."""

    q: F64
    k: F64
    v: F64
    dout: F64
    bias: F64
    mask: NDArray[np.bool_]
    options: Options

    def run(self, **changes: Any) -> Gradients:
        p = dataclasses.replace(self, **changes)
        spec = build_spec(p.q, p.k, p.v, bias=p.bias, mask=p.mask, options=p.options)
        return backward(spec, make_dout(spec, p.dout, 0, "dO"))


@st.composite
def problems(
    draw: st.DrawFn,
    *,
    positional: bool = True,
    dropout: bool = True,
    every_row_sums_to_one: bool = False,
) -> Problem:
    """Small problems. ``positional``: causal masks, windows, key padding (which a key
    permutation would not respect). ``every_row_sums_to_one``: no row is left without
    a visible key under −inf (key 0 stays visible), so every row's weights sum to 1."""
    Bp, Hp = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Lp, Sp = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    Ep, Evp = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    q = draw(arrays(np.float64, (Bp, Hp, Lp, Ep), elements=VALUES))
    k = draw(arrays(np.float64, (Bp, Hp, Sp, Ep), elements=VALUES))
    v = draw(arrays(np.float64, (Bp, Hp, Sp, Evp), elements=VALUES))
    dout = draw(arrays(np.float64, (Bp, Hp, Lp, Evp), elements=VALUES))
    bias = draw(arrays(np.float64, (Bp, Hp, Lp, Sp), elements=VALUES))
    mask = draw(arrays(np.bool_, (Bp, 1, Lp, Sp), elements=st.booleans()))
    options: dict[str, Any] = {
        "scale": draw(st.sampled_from(["sqrt-dk", "dk", "none", 0.7])),
        "temperature": draw(st.sampled_from([1.0, 0.5, 3.0])),
        "softcap": draw(st.none() | st.sampled_from([1.0, 5.0])),
        "mask_value": draw(st.sampled_from([-math.inf, -1e9])),
    }
    hidden_rows_allowed = not every_row_sums_to_one or options["mask_value"] != -math.inf
    if positional:
        options["causal"] = draw(st.booleans())
        options["causal_align"] = draw(st.sampled_from(["upper-left", "lower-right"]))
        if options["causal_align"] == "lower-right" and Lp > Sp and not hidden_rows_allowed:
            options["causal_align"] = "upper-left"
        options["key_lengths"] = draw(
            st.none() | st.tuples(*[st.integers(0 if hidden_rows_allowed else 1, Sp)] * Bp)
        )
        if hidden_rows_allowed:
            options["window"] = draw(st.none() | st.tuples(st.integers(0, 3), st.integers(0, 3)))
    if dropout:
        options["dropout"] = draw(st.sampled_from([0.0, 0.3]))
        options["seed"] = draw(st.integers(0, 3))
    if not hidden_rows_allowed:
        mask[..., 0] = True
    return Problem(q, k, v, dout, bias, mask, Options(**options))


@BOUNDED
@given(problems())
def test_every_row_of_the_logits_gradient_sums_to_zero(problem: Problem) -> None:
    """Σ_j dS_ij = Σ_j A_ij (dA_ij − Σ_k dA_ik A_ik) = 0 when Σ_j A_ij is 1 (or 0),
    seen through d(bias), which is d(logits) for a full-shape bias."""
    grads = problem.run()
    assert grads.dbias is not None
    assert grads.dbias.shape == problem.bias.shape
    sums = grads.dbias.sum(axis=-1)
    bound = 1e-14 * grads.spec.S * (1.0 + grads.da_norm) + 1e-300
    assert np.all(np.abs(sums) <= bound), (sums, bound)


@BOUNDED
@given(problems(dropout=False), st.floats(-20, 20))
def test_a_constant_added_to_v_changes_no_logit_gradient(problem: Problem, c: float) -> None:
    """V + c: dA gains c · Σ_e dO_ie, the same for every key of row i, which the
    softmax's Jacobian sends to 0. dQ, dK and d(bias) stay; dV never read V."""
    before = problem.run()
    after = problem.run(v=problem.v + c)
    tol = 1e-12 * (1.0 + abs(c))
    for name in ("dq", "dk", "dbias"):
        got, want = after.tensor(name), before.tensor(name)
        assert got is not None
        assert want is not None
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=tol, err_msg=name)
    np.testing.assert_array_equal(after.dv, before.dv)


@BOUNDED
@given(problems(dropout=False, every_row_sums_to_one=True))
def test_v_gradient_sums_over_keys_to_the_sum_of_dout(problem: Problem) -> None:
    """Σ_s dV_s = Σ_s Σ_l A_ls dO_l = Σ_l dO_l, when every row's weights sum to 1
    (a row hidden under a finite mask value is uniform: it sums to 1 too)."""
    grads = problem.run()
    np.testing.assert_allclose(
        grads.dv.sum(axis=-2), problem.dout.sum(axis=-2), rtol=1e-12, atol=1e-12
    )


@BOUNDED
@given(problems(positional=False, dropout=False), st.randoms(use_true_random=False))
def test_permuting_keys_permutes_their_gradients(problem: Problem, rnd: Any) -> None:
    """K, V, the bias's and the mask's key axis permuted together: dK, dV and d(bias)
    permute the same way and dQ does not change."""
    S_ = problem.k.shape[-2]
    perm = list(range(S_))
    rnd.shuffle(perm)
    before = problem.run()
    after = problem.run(
        k=problem.k[..., perm, :],
        v=problem.v[..., perm, :],
        bias=problem.bias[..., perm],
        mask=problem.mask[..., perm],
    )
    assert before.dbias is not None
    assert after.dbias is not None
    np.testing.assert_allclose(after.dq, before.dq, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(after.dk, before.dk[..., perm, :], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(after.dv, before.dv[..., perm, :], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(after.dbias, before.dbias[..., perm], rtol=1e-10, atol=1e-12)


# --- 5. the health records -----------------------------------------------------------------


def test_a_saturated_row_passes_nothing_back_and_a_uniform_row_passes_most() -> None:
    """Row 0: key 0's logit 60 above every other (A ≈ one-hot): 1 − Σ A² < 10⁻¹²,
    ‖dS‖ ≈ 0 beside ‖dA‖, dQ ≈ 0. Row 1: q = 0, every logit equal: 1 − Σ A² = 1 − 1/S."""
    S_ = 8
    q = np.zeros((2, 4))
    q[0, 0] = 1.0
    k = normal(70, S_, 4)
    k[:, 0] = np.linspace(-0.5, 0.5, S_)
    k[0, 0] = 60.0
    v = normal(71, S_, 3)
    spec = build_spec(q, k, v, options=Options(scale="none"))
    dout = make_dout(spec, "random", 5, "--dout")
    grads = backward(spec, dout)
    da = dout @ v.T  # (2, S): nothing masked

    assert grads.gain[0] < 1e-12
    assert grads.max_weight[0] == pytest.approx(1.0, abs=1e-15)
    assert grads.argmax[0] == 0
    assert grads.da_norm[0] == pytest.approx(np.linalg.norm(da[0]), rel=1e-14)
    assert grads.da_norm[0] > 0.1
    assert grads.ds_norm[0] < 1e-12 * grads.da_norm[0]
    assert np.all(np.abs(grads.dq[0]) < 1e-12)

    assert grads.gain[1] == 1.0 - 1.0 / S_
    assert grads.max_weight[1] == 1.0 / S_
    assert grads.n_visible[1] == S_
    assert grads.ds_norm[1] > 0.1 * grads.da_norm[1]
    assert grads.ds_norm[1] <= grads.gain[1] * grads.da_norm[1]


@pytest.mark.parametrize(
    "mask_value",
    [
        -math.inf,
        -1e9,
    ],
)
def test_a_row_with_no_visible_key_records_nothing_and_passes_nothing(
    mask_value: float,
) -> None:
    """Batch item 0 has no key (key_lengths 0): no visible key, no gain, no dS, and
    exactly zero dQ, dK and dV; item 1's padded keys (3, 4) are never seen and get
    exactly zero dK and dV."""
    q, k, v = normal(80, 2, 2, 3, 4), normal(81, 2, 2, 5, 4), normal(82, 2, 2, 5, 3)
    spec = build_spec(q, k, v, options=Options(key_lengths=(0, 3), mask_value=mask_value))
    grads = backward(spec, make_dout(spec, "random", 6, "--dout"))
    assert np.all(grads.n_visible[0] == 0)
    assert np.all(grads.n_visible[1] == 3)
    assert np.all(grads.gain[0] == 0.0)
    assert np.all(grads.da_norm[0] == 0.0)
    assert np.all(grads.dq[0] == 0.0)
    assert np.all(grads.dk[0] == 0.0)
    assert not grads.key_seen[0].any()
    assert np.all(grads.key_seen[1, :, :3])
    assert not grads.key_seen[1, :, 3:].any()
    assert np.all(grads.key_weight[1, :, 3:] == 0.0)
    assert np.all(grads.dk[1, :, 3:] == 0.0)
    assert np.all(grads.dv[1, :, 3:] == 0.0)
    assert np.all(np.abs(grads.dk[1, :, :3]) > 0.0)
    if mask_value == -math.inf:
        assert np.all(grads.dv[0] == 0.0)  # no weight at all (a uniform row under −1e9)
    assert np.all(grads.ds_norm[0] == 0.0)


def jacobian_bound_problem(mask_value: float) -> tuple[AttentionSpec, F64]:
    """Causal, padded (one item without keys), a bias, dropout, some saturated rows."""
    q, k, v = normal(90, 2, 3, 7, 4) * 3, normal(91, 2, 3, 9, 4), normal(92, 2, 3, 9, 3)
    spec = build_spec(
        q,
        k,
        v,
        bias=normal(93, 7, 9),
        options=Options(
            scale="none",
            causal=True,
            key_lengths=(9, 0),
            dropout=0.2,
            seed=1,
            mask_value=mask_value,
        ),
    )
    return spec, make_dout(spec, "random", 7, "--dout")


@pytest.mark.parametrize(
    "mask_value",
    [
        -math.inf,
        -1e9,
    ],
)
def test_logit_gradient_norm_is_bounded_by_gain_times_weight_gradient_norm(
    mask_value: float,
) -> None:
    """diag(A) − A Aᵀ is positive semi-definite with trace 1 − Σ A², so its norm is at
    most that: ‖dS‖ ≤ (1 − Σ A²) ‖dA‖ on every row."""
    spec, dout = jacobian_bound_problem(mask_value)
    grads = backward(spec, dout)
    assert np.any(grads.gain[0] < 1e-6)  # some rows saturate
    assert np.any(grads.gain[0] > 0.3)  # some do not
    bounded = grads.ds_norm <= grads.gain * grads.da_norm + 1e-12
    assert np.all(bounded[grads.n_visible > 0])
    assert np.any(grads.n_visible == 0)
    assert np.all(bounded)  # rows without a visible key, too


def test_row_and_key_records_are_their_definitions() -> None:
    """Every record recomputed from the forward trace's weights and dO Vᵀ."""
    spec, dout = jacobian_bound_problem(-math.inf)
    grads = backward(spec, dout, rows=2)
    t = trace(spec, stages=("weights", "masked"))
    assert t.weights is not None
    assert t.visible is not None
    a, visible = t.weights, t.visible
    v = np.broadcast_to(spec.v, (*spec.lead, spec.S, spec.Ev))
    keep = keep_mask(spec) / 0.8
    da = np.einsum("BHLe,BHSe->BHLS", dout, v) * keep
    ds = a * (da - np.sum(da * a, axis=-1, keepdims=True))
    np.testing.assert_array_equal(grads.n_visible, visible.sum(axis=-1))
    np.testing.assert_allclose(
        grads.da_norm, np.linalg.norm(da * visible, axis=-1), rtol=1e-12, atol=1e-14
    )
    np.testing.assert_allclose(grads.ds_norm, np.linalg.norm(ds, axis=-1), rtol=1e-12, atol=1e-14)
    gain = np.where(visible.any(axis=-1), 1.0 - np.sum(a * a, axis=-1), 0.0)
    np.testing.assert_allclose(grads.gain, gain, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grads.max_weight, a.max(axis=-1), rtol=1e-12, atol=1e-14)
    sees = visible.any(axis=-1)
    np.testing.assert_array_equal(grads.argmax, np.where(sees, a.argmax(axis=-1), -1))
    np.testing.assert_allclose(grads.key_weight, (a * visible).max(axis=-2), rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(grads.key_seen, visible.any(axis=-2))
    assert grads.gain.shape == grads.ds_norm.shape == (*spec.lead, spec.L)
    assert grads.key_weight.shape == grads.key_seen.shape == (*spec.lead, spec.S)
    assert grads.dq.shape == spec.q.shape
    assert grads.dk.shape == spec.k.shape
    assert grads.dv.shape == spec.v.shape
    assert grads.dbias is not None
    assert spec.bias is not None
    assert grads.dbias.shape == spec.bias.shape


# --- 6. make_dout -------------------------------------------------------------------------


def test_dout_ones_is_ones_in_the_engine_layout() -> None:
    spec = CASES[0].spec
    dout = make_dout(spec, "ones", 0, "--dout")
    assert dout.shape == spec.output_shape == (B, H, L, EV)
    assert dout.dtype == np.float64
    assert np.all(dout == 1.0)


def test_dout_random_is_seeded_standard_normal() -> None:
    spec = CASES[0].spec
    first, again = make_dout(spec, "random", 3, "x"), make_dout(spec, "random", 3, "x")
    np.testing.assert_array_equal(first, again)
    assert not np.any(make_dout(spec, "random", 4, "x") == first)
    big = build_spec(np.zeros((4, 8, 256, 2)), np.zeros((4, 8, 3, 2)), np.zeros((4, 8, 3, 32)))
    sample = make_dout(big, "random", 0, "x")
    assert sample.shape == (4, 8, 256, 32)
    assert abs(sample.mean()) < 0.01
    assert abs(sample.std() - 1.0) < 0.01


def test_dout_of_the_wrong_shape_names_the_expected_one() -> None:
    spec = CASES[0].spec
    with pytest.raises(SpecError, match=r"dO should have the output's shape \(2, 3, 4, 5\)"):
        make_dout(spec, np.zeros((2, 3, 4, 4)), 0, "grad.npy")
    with pytest.raises(SpecError) as caught:
        make_dout(spec, np.zeros((3, 4, 5)), 0, "grad.npy")
    assert caught.value.where == "grad.npy"
    assert "(2, 3, 4, 5)" in caught.value.problem
    assert "(3, 4, 5)" in caught.value.problem
    with pytest.raises(SpecError, match="ones or random"):
        make_dout(spec, "zeros", 0, "--dout")
    # Leading axes of size 1 may differ.
    given_ = normal(100, 1, B, H, L, EV)
    np.testing.assert_array_equal(make_dout(spec, given_, 0, "x"), given_[0])


def test_dout_given_with_heads_merged_reaches_the_right_heads(torch: Any) -> None:
    """Under heads=2 a dO file is (B, L, 2·Ev), as the output is returned: column block
    h belongs to head h. dV (and dQ, dK) equal torch's for the same merged dO."""
    case = next(c for c in CASES if c.name == "heads-2")
    spec = case.spec
    merged = normal(101, B, L, 2 * EV)
    merged[..., EV:] *= 10.0  # head 1's dO ten times head 0's: a swap would show
    dout = make_dout(spec, merged, 0, "grad.npy")
    assert dout.shape == (B, 2, L, EV)
    np.testing.assert_array_equal(dout[:, 1], merged[..., EV:])
    grads = backward(spec, dout)

    t = {n: torch.tensor(a, requires_grad=True) for n, a in case.arrays.items()}
    out = torch_sdpa(torch, {n: split(torch, x, 2) for n, x in t.items()})  # (B, 2, L, Ev)
    as_returned = out.transpose(1, 2).reshape(B, L, 2 * EV)
    (as_returned * torch.from_numpy(merged)).sum().backward()
    for name in ("q", "k", "v"):
        got = grads.loaded("d" + name)
        assert got is not None
        np.testing.assert_allclose(got, t[name].grad.numpy(), rtol=RTOL, atol=ATOL, err_msg=name)


# --- 7. NaN in V where no query looks ------------------------------------------------------


@pytest.mark.parametrize("rows", [1, None])
def test_nan_in_a_hidden_v_row_spreads_as_in_a_dense_kernel(torch: Any, rows: int | None) -> None:
    """V[1, :, 5, 2] is NaN, a key padding hides from batch item 1. A dense kernel
    multiplies it by its zero weight: dA's column 5 is NaN, so is every row sum
    Σ_k dA_ik A_ik, so dQ is NaN on every row of item 1, as torch's SDPA gives.
    dK of the hidden key is 0 (a replaced logit gets no gradient: masked_fill's
    backward; SDPA's additive −inf mask instead passes NaN there), NaN elsewhere in
    item 1; dV stays finite (Pᵀ dO does not read V). Item 0 is untouched."""
    q, k, v = qkv()
    v[1, :, 5, 2] = np.nan
    case = Case(
        "nan",
        q,
        k,
        v,
        lambda torch, t: torch_sdpa(torch, t, attn_mask=padding_visible((6, 5), L, S)),
        options=Options(key_lengths=(6, 5)),
    )
    grads = case.gradients(rows=rows)
    sdpa = torch_gradients(torch, case.reference, case.arrays, grads.dout)
    graph = torch_gradients(
        torch,
        lambda torch, t: torch_graph(
            torch, t, factor=1 / math.sqrt(E), visible=padding_visible((6, 5), L, S)
        ),
        case.arrays,
        grads.dout,
    )

    assert np.all(np.isnan(grads.dq[1]))
    np.testing.assert_array_equal(np.isnan(grads.dq), np.isnan(sdpa["dq"]))
    np.testing.assert_allclose(grads.dq[0], sdpa["dq"][0], rtol=RTOL, atol=ATOL)

    assert np.all(grads.dk[1, :, 5] == 0.0)
    assert np.all(np.isnan(grads.dk[1, :, :5]))
    np.testing.assert_array_equal(np.isnan(grads.dk), np.isnan(graph["dk"]))
    np.testing.assert_allclose(grads.dk, graph["dk"], rtol=RTOL, atol=ATOL)  # NaNs equal

    assert np.all(np.isfinite(grads.dv))
    np.testing.assert_allclose(grads.dv, sdpa["dv"], rtol=RTOL, atol=ATOL)


def test_nan_in_v_behind_a_causal_mask_reaches_the_rows_that_skip_it() -> None:
    """Key 5 (NaN in V) is hidden by the causal mask from rows 0..4: a block of those
    rows would skip it, but a dense kernel's 0 · NaN reaches them, and so must dQ."""
    q, k, v = qkv(6, 6, (1, 1), (1, 1))
    v[0, 0, 5, 0] = np.nan
    spec = build_spec(q, k, v, options=Options(causal=True))
    for rows in (1, 2, None):
        grads = backward(spec, make_dout(spec, "random", 8, "--dout"), rows=rows)
        assert np.all(np.isnan(grads.dq)), rows
        assert np.all(np.isfinite(grads.dv)), rows


def test_a_float16_dout_is_kept_as_it_is_and_gives_the_same_gradients() -> None:
    # a quarter of the memory of float64; every float16 value is exact in float64
    spec = make_spec(9, **MASK_CASES["causal-window-padding"])
    wide = make_dout(spec, "random", 4, "--dout")
    half = make_dout(spec, wide.astype(np.float16), 4, "dout.npy")
    assert half.dtype == np.float16
    exact = backward(spec, half.astype(np.float64))
    kept = backward(spec, half)
    for name in ("dq", "dk", "dv", "da_norm", "ds_norm"):
        np.testing.assert_array_equal(getattr(kept, name), getattr(exact, name), err_msg=name)
    assert make_dout(spec, wide.astype(np.int64), 4, "dout.npy").dtype == np.float64
