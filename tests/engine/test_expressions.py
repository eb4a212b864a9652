"""``--score-mod`` and ``--mask-mod`` (FlexAttention's score_mod and mask_mod) against
PyTorch's ``flex_attention`` on CPU in float64 at 1e-9, the lean pass against the
per-stage path, and the expression language's refusals (one line, naming the token)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from attention_cases import random_qkv
from clirunner import assert_one_error_line, invoke
from numpy.typing import NDArray

from sdpa_cli.engine import online
from sdpa_cli.engine.expressions import parse_mask_mod, parse_score_mod
from sdpa_cli.engine.options import Options, parse_options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

F64 = NDArray[np.float64]
B, H, L, S, E = 2, 3, 12, 12, 4
TOL = 1e-9


def inputs(seed: int = 0) -> tuple[F64, F64, F64]:
    return random_qkv(seed, B, H, L, S, E, 3)


def spec_of(**options: Any) -> AttentionSpec:
    q, k, v = inputs()
    return build_spec(q, k, v, options=parse_options(options))


# The same modification twice: as sdpa's expression and as the torch function (whose
# int index tensors times a Python float give float32: cast to float64 first).
MASKS: dict[str, tuple[str, Callable[..., Any]]] = {
    "causal": ("q_idx >= kv_idx", lambda b, h, q, k: q >= k),
    "sliding-window": (
        "q_idx >= kv_idx and q_idx - kv_idx < 3",
        lambda b, h, q, k: (q >= k) & (q - k < 3),
    ),
    "documents-by-item-and-head": (
        "q_idx // (4 + b) == kv_idx // (4 + b) and (h == 1 or q_idx >= kv_idx)",
        lambda b, h, q, k: (q // (4 + b) == k // (4 + b)) & ((h == 1) | (q >= k)),
    ),
    "not-and-modulo": ("not (kv_idx % 3 == 1)", lambda b, h, q, k: ~(k % 3 == 1)),
}
SCORES: dict[str, tuple[str, Callable[..., Any]]] = {
    "alibi-like": (
        "score - 0.25 * (h + 1) * abs(q_idx - kv_idx)",
        lambda s, b, h, q, k: s - 0.25 * (h + 1).double() * torch.abs(q - k).double(),
    ),
    "relative": (
        "score + 0.1 * (kv_idx - q_idx)",
        lambda s, b, h, q, k: s + 0.1 * (k - q).double(),
    ),
    "softcap": ("2 * tanh(score / 2)", lambda s, b, h, q, k: 2 * torch.tanh(s / 2)),
    "where-by-item": (
        "where(b == 0, maximum(score, -1), score ** 2 / sqrt(1 + kv_idx))",
        lambda s, b, h, q, k: torch.where(
            b == 0, torch.clamp(s, min=-1), s**2 / torch.sqrt(1 + k.to(s.dtype))
        ),
    ),
}


def flex_reference(
    score_mod: Callable[..., Any] | None, mask_mod: Callable[..., Any] | None
) -> F64:
    q, k, v = (torch.from_numpy(a) for a in inputs())
    block_mask = None
    if mask_mod is not None:
        block_mask = flex.create_block_mask(mask_mod, B, H, L, S, device="cpu")
    with _quiet():  # flex_attention warns that it runs unfused without torch.compile
        out = flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    return out.numpy()  # type: ignore[no-any-return]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Warnings silenced (flex_attention warns that it runs unfused on CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("name", MASKS)
def test_mask_mod_equals_flex_attention(name: str) -> None:
    text, fn = MASKS[name]
    got = trace(spec_of(mask_mod=text), stages=("output",)).output
    assert got is not None
    np.testing.assert_allclose(got, flex_reference(None, fn), rtol=0, atol=TOL)


@pytest.mark.parametrize("name", SCORES)
def test_score_mod_equals_flex_attention(name: str) -> None:
    text, fn = SCORES[name]
    got = trace(spec_of(score_mod=text), stages=("output",)).output
    assert got is not None
    np.testing.assert_allclose(got, flex_reference(fn, None), rtol=0, atol=TOL)


def test_both_with_the_causal_option_equal_flex_attention() -> None:
    text, fn = SCORES["alibi-like"]
    mtext, mfn = MASKS["sliding-window"]
    spec = spec_of(score_mod=text, mask_mod=mtext, scale=0.3, causal=True)
    got = trace(spec, stages=("output",)).output
    assert got is not None
    q, k, v = (torch.from_numpy(a) for a in inputs())
    block_mask = flex.create_block_mask(mfn, B, H, L, S, device="cpu")
    with _quiet():
        want = flex.flex_attention(q, k, v, score_mod=fn, block_mask=block_mask, scale=0.3)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=TOL)


def test_score_mod_sees_the_scaled_scores_and_fills_the_biased_stage() -> None:
    got = trace(spec_of(score_mod="score * 3 + kv_idx"), stages=("scaled", "biased"))
    assert got.scaled is not None
    assert got.biased is not None
    np.testing.assert_allclose(got.biased, got.scaled * 3 + np.arange(S), rtol=0, atol=TOL)


@pytest.mark.parametrize("name", MASKS)
def test_the_lean_pass_keeps_the_mask_mod(name: str) -> None:
    spec = spec_of(mask_mod=MASKS[name][0])
    assert online.applies(spec)
    lean = trace(spec, stages=("output",), summarize=("output",), rows=5)
    staged = trace(spec, stages=("weights", "output"), rows=5)
    assert lean.output is not None
    assert staged.output is not None
    np.testing.assert_allclose(lean.output, staged.output, rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(lean.stats.n_visible, staged.stats.n_visible)


def test_the_lean_pass_leaves_score_mod_to_the_per_stage_path() -> None:
    assert not online.applies(spec_of(score_mod="score"))


def test_a_huge_exponent_is_inf_not_an_error() -> None:
    got = trace(spec_of(score_mod="score + 2 ** 100000 - 2 ** 100000"), stages=("biased",))
    assert got.biased is not None
    assert np.isnan(got.biased).all()
    assert parse_score_mod("score ** 1e308") == "score ** 1e308"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("score.__class__", "'score.__class__' at column 6: attribute access is not allowed"),
        ("__import__('os')", "'__import__' at column 1: unknown function"),
        ("(lambda: score)()", "'lambda: score' at column 2: lambda is not allowed"),
        ("score[0]", "'score[0]' at column 1: subscripting is not allowed"),
        ("score + x", "'x' at column 9: unknown name; allowed: score, b, h, q_idx, kv_idx"),
        ("exp", "'exp' at column 1: unknown name (call it)"),
        ("exp(score, 2)", "exp takes 1 argument"),
        ("abs(x=score)", "'x=score' at column 5: keyword arguments are not allowed"),
        ("'score'", "only numbers are allowed as constants"),
        ("score if b else 0", "use where(c, x, y)"),
        ("eval('1')", "'eval' at column 1: unknown function"),
        ("score +", "'score +'"),
        ("", "expected an expression"),
    ],
)
def test_hostile_or_unknown_expressions_are_refused(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=r"^--score-mod: ") as e:
        parse_score_mod(text)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_mask_mod_has_no_score() -> None:
    with pytest.raises(SpecError, match="'score' at column 1: unknown name; allowed: b, h"):
        parse_mask_mod("score > 0")


@pytest.mark.parametrize("option", [{"softcap": 5.0}, {"alibi": True}])
def test_score_mod_replaces_softcap_bias_and_alibi(option: dict[str, Any]) -> None:
    q, k, v = inputs()
    with pytest.raises(SpecError, match="with --score-mod: write it into the expression"):
        build_spec(q, k, v, options=Options(score_mod="score", **option))
    with pytest.raises(SpecError, match=r"^--bias: with --score-mod"):
        build_spec(q, k, v, bias=np.zeros((L, S)), options=Options(score_mod="score"))


def test_the_command_line_refuses_in_one_line(tmp_path: Any) -> None:
    paths = []
    for name, a in zip("qkv", inputs(), strict=True):
        np.save(tmp_path / f"{name}.npy", a)
        paths.append(str(tmp_path / f"{name}.npy"))
    line = assert_one_error_line(invoke("compute", *paths, "--score-mod", "score.__class__"))
    assert line == (
        "sdpa: error: --score-mod: 'score.__class__' at column 6: attribute access is not allowed"
    )
    line = assert_one_error_line(invoke("compute", *paths, "--mask-mod", "__import__('os')"))
    assert line.startswith("sdpa: error: --mask-mod: '__import__' at column 1: unknown function")
    ok = invoke("compute", *paths, "--mask-mod", "q_idx >= kv_idx", "--score-mod", "score")
    assert ok.exit_code == 0, ok.stderr
    line = assert_one_error_line(invoke("grad", *paths, "--score-mod", "score"))
    assert "--score-mod: has no backward pass here" in line


def test_a_very_long_expression_is_refused_before_python_parses_it() -> None:
    """A flat chain of 20,000 terms once ran Python's parser out of stack (exit 3)."""
    with pytest.raises(
        SpecError, match="is 119999 characters long; an expression may be up to 2000"
    ):
        parse_score_mod("+".join(["score"] * 20_000))
    assert parse_score_mod("+".join(["score"] * 300)).startswith("score+score")


def test_what_an_error_echoes_of_the_expression_is_cut_short() -> None:
    with pytest.raises(SpecError) as e:
        parse_score_mod("score + " + "@" * 1500)
    assert "..." in str(e.value)
    assert len(str(e.value)) < 140
