"""``--dropout-mask``: a framework's own dropout keep mask replayed in place of the
engine's Philox stream. Against PyTorch's ``F.dropout`` (the same seed gives the same
mask on the weights as on ones), a float64 loop and torch autograd, at 1e-9."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from attention_cases import random_qkv
from clirunner import assert_one_error_line, invoke
from numpy.typing import NDArray

from sdpa_cli.engine.grad import backward
from sdpa_cli.engine.options import Options
from sdpa_cli.engine.spec import AttentionSpec, build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.errors import SpecError

torch = pytest.importorskip("torch")

F64 = NDArray[np.float64]
B, H, L, S, E = 2, 2, 4, 5, 3
P = 0.4
TOL = 1e-9


def inputs(seed: int = 0) -> tuple[F64, F64, F64]:
    return random_qkv(seed, B, H, L, S, E, E)


def torch_keep(seed: int = 3) -> NDArray[np.bool_]:
    """PyTorch's own keep mask: what ``F.dropout`` keeps of ones under ``seed``."""
    torch.manual_seed(seed)
    kept = torch.nn.functional.dropout(torch.ones(B, H, L, S, dtype=torch.float64), P) != 0
    mask: NDArray[np.bool_] = kept.numpy()
    return mask


def torch_weights(q: Any, k: Any, causal: bool) -> Any:
    s = q @ k.transpose(-1, -2) / math.sqrt(E)
    if causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(s, dim=-1)


def spec_of(keep: NDArray[Any], causal: bool = False) -> AttentionSpec:
    return build_spec(*inputs(), options=Options(dropout=P, causal=causal), dropout_mask=keep)


@pytest.mark.parametrize("causal", [False, True])
def test_the_output_replays_torch_dropout_with_the_same_seed(causal: bool) -> None:
    q, k, v = (torch.from_numpy(a) for a in inputs())
    torch.manual_seed(3)
    ref = torch.nn.functional.dropout(torch_weights(q, k, causal), P) @ v
    out = trace(spec_of(torch_keep(), causal), stages=("output",)).output
    assert out is not None
    np.testing.assert_allclose(out, ref.numpy(), rtol=0, atol=TOL)


def test_the_dropped_weights_are_a_float64_loop_of_the_keep_mask() -> None:
    keep = torch_keep()
    t = trace(spec_of(keep), stages=("weights", "dropped", "output"))
    assert t.weights is not None
    assert t.dropped is not None
    assert t.output is not None
    _, _, v = inputs()
    for b, h, i in np.ndindex(B, H, L):
        row = [t.weights[b, h, i, j] * keep[b, h, i, j] / (1 - P) for j in range(S)]
        np.testing.assert_allclose(t.dropped[b, h, i], row, rtol=0, atol=TOL)
        out = [sum(row[j] * v[b, h, j, e] for j in range(S)) for e in range(E)]
        np.testing.assert_allclose(t.output[b, h, i], out, rtol=0, atol=TOL)


def test_a_mask_of_l_by_s_serves_every_head() -> None:
    keep = torch_keep()[0, 0]
    q, k, v = (torch.from_numpy(a) for a in inputs())
    ref = (torch_weights(q, k, False) * torch.from_numpy(keep) / (1 - P)) @ v
    out = trace(spec_of(keep.astype(np.int64)), stages=("output",)).output
    assert out is not None
    np.testing.assert_allclose(out, ref.numpy(), rtol=0, atol=TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_the_gradients_match_torch_autograd_with_the_same_mask(causal: bool) -> None:
    keep = torch_keep()
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in inputs())
    dout = np.random.default_rng(9).normal(size=(B, H, L, E))
    out = (torch_weights(q, k, causal) * torch.from_numpy(keep) / (1 - P)) @ v
    out.backward(torch.from_numpy(dout))
    grads = backward(spec_of(keep, causal), dout)
    for ours, theirs in ((grads.dq, q), (grads.dk, k), (grads.dv, v)):
        assert theirs.grad is not None
        np.testing.assert_allclose(ours, theirs.grad.numpy(), rtol=0, atol=TOL)


@pytest.mark.parametrize(
    ("keep", "options", "message"),
    [
        (
            np.ones((L, S), dtype=np.bool_),
            {},
            "--dropout-mask: replays dropout's keep mask; give --dropout P beside it",
        ),
        (
            np.full((L, S), 2),
            {"dropout": P},
            "--dropout-mask: holds values other than 0 and 1; a keep mask is boolean or 0/1",
        ),
        (
            np.ones((3, S), dtype=np.bool_),
            {"dropout": P},
            "--dropout-mask: keep mask of shape (3, 5) does not broadcast to the scores' shape (2, 2, 4, 5) (..., L, S)",
        ),
    ],
)
def test_a_bad_dropout_mask_is_one_line(
    keep: NDArray[Any], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(SpecError) as err:
        build_spec(*inputs(), options=Options(**options), dropout_mask=keep)
    assert str(err.value) == message


def test_grad_on_the_command_line_replays_the_mask(tmp_path: Path) -> None:
    paths = []
    for name, a in zip("qkv", inputs(), strict=True):
        np.save(tmp_path / f"{name}.npy", a)
        paths.append(str(tmp_path / f"{name}.npy"))
    keep = torch_keep()
    np.save(tmp_path / "keep.npy", keep)
    flags = ("--dropout", str(P), "--dropout-mask", str(tmp_path / "keep.npy"), "--dout", "ones")
    result = invoke("grad", *paths, *flags, "--save", str(tmp_path / "g.npz"))
    assert result.exit_code == 0, result.output
    q, k, v = (torch.from_numpy(a).requires_grad_() for a in inputs())
    ((torch_weights(q, k, False) * torch.from_numpy(keep) / (1 - P)) @ v).sum().backward()
    with np.load(tmp_path / "g.npz") as z:
        assert q.grad is not None
        np.testing.assert_allclose(z["dq"], q.grad.numpy(), rtol=0, atol=TOL)
    line = assert_one_error_line(
        invoke("compute", *paths, "--dropout-mask", str(tmp_path / "keep.npy"))
    )
    assert (
        line
        == "sdpa: error: --dropout-mask: replays dropout's keep mask; give --dropout P beside it"
    )
