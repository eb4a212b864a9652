"""Tests of `capture(backward=True)` and `sdpa capture --backward` on plain PyTorch calls:
a backward pass's dO and dQ, dK, dV recorded in each call's file and listed in its case,
the program's gradients unchanged, which tensors get hooks and when they are removed, the
bytes counted; tests/capture/test_backward_models.py has the real models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from clirunner import invoke

from sdpa_cli.capture import capture

torch = pytest.importorskip("torch")
F = torch.nn.functional
Function: Any = torch.autograd.Function
GRADIENT_KEYS = ("dout", "expect-dq", "expect-dk", "expect-dv")


def leaves(
    b: int = 2, h: int = 4, g: int = 2, n: int = 8, e: int = 16, dtype: Any = None, seed: int = 0
) -> list[Any]:
    """Q (B, H, L, E), K and V (B, G, L, E), standard normal, requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((b, h, n, e), (b, g, n, e), (b, g, n, e))
    t = dtype or torch.float32
    return [torch.randn(s, generator=gen).to(t).requires_grad_(True) for s in shapes]


def tensors_of(path: Path) -> dict[str, Any]:
    """A call file's tensors, as torch reads safetensors (the format by hand)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    data = raw[8 + n :]
    out = {}
    for name, e in header.items():
        start, end = e["data_offsets"]
        flat = torch.frombuffer(bytearray(data[start:end]), dtype=dtypes[e["dtype"]])
        out[name] = flat.reshape(e["shape"])
    return out


def manifest_of(folder: Path) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = yaml.safe_load((folder / "manifest.yaml").read_text())["cases"]
    return cases


def calls_of(folder: Path) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = yaml.safe_load((folder / "calls.yaml").read_text())["calls"]
    return calls


def check(folder: Path) -> tuple[int, dict[str, Any]]:
    result = invoke(
        "check", "--manifest", str(folder / "manifest.yaml"), "--jobs", "1", "--format", "json"
    )
    assert result.exit_code in (0, 1), result.output
    report: dict[str, Any] = json.loads(result.stdout)
    return result.exit_code, report


def checks_of(case: dict[str, Any]) -> dict[str, bool]:
    return {c["name"]: c["passed"] for c in case["checks"]}


# --- what is recorded ---------------------------------------------------------------------


def test_a_backward_pass_records_dout_and_the_gradients_and_check_judges_them(
    tmp_path: Path,
) -> None:
    q, k, v = leaves(dtype=torch.bfloat16)
    dout = torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    with capture(tmp_path / "run", backward=True) as cap:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(dout)
    assert cap.summary is not None
    assert cap.summary.gradients == 1
    assert ", 1 with its gradients;" in cap.summary.line()
    saved = tensors_of(tmp_path / "run/tensors/00001-call-1.safetensors")
    assert list(saved) == ["q", "k", "v", "output", "dout", "dq", "dk", "dv"]
    assert torch.equal(saved["dout"], dout)
    for name, leaf in zip(("dq", "dk", "dv"), (q, k, v), strict=True):
        assert torch.equal(saved[name], leaf.grad)  # K and V's: (B, G, S, E), as K and V
    (case,) = manifest_of(tmp_path / "run")
    file = "tensors/00001-call-1.safetensors"
    assert {key: case[key] for key in GRADIENT_KEYS} == {
        "dout": f"{file}:dout",
        "expect-dq": f"{file}:dq",
        "expect-dk": f"{file}:dk",
        "expect-dv": f"{file}:dv",
    }
    keys = list(case)  # the gradients after the tensors, before the options
    assert keys.index("expect-dv") < keys.index("causal")
    (call,) = calls_of(tmp_path / "run")
    assert call["gradients"] == ["dout", "dq", "dk", "dv"]
    assert call["bytes"] == (tmp_path / "run" / file).stat().st_size == cap.summary.bytes
    case_file = yaml.safe_load((tmp_path / "run/tensors/00001-call-1.yaml").read_text())
    assert not any(key in case_file for key in GRADIENT_KEYS)  # a case file takes none
    code, report = check(tmp_path / "run")
    assert code == 0, report["cases"][0]["checks"]
    assert {"dq.close", "dk.close", "dv.close", "dv.sums"} <= set(checks_of(report["cases"][0]))


def test_a_backward_kernel_with_a_wrong_dk_fails_naming_dk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sdpa = F.scaled_dot_product_attention

    class DoubledDK(Function):  # type: ignore[misc]
        """torch's SDPA forward, and its backward with dK twice too large."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any) -> Any:
            ctx.save_for_backward(q, k, v)
            return sdpa(q, k, v)

        @staticmethod
        def backward(ctx: Any, dout: Any) -> Any:
            with torch.enable_grad():
                q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
                dq, dk, dv = torch.autograd.grad(sdpa(q, k, v), (q, k, v), dout)
            return dq, 2 * dk, dv

    def scaled_dot_product_attention(q: Any, k: Any, v: Any) -> Any:
        return DoubledDK.apply(q, k, v)

    monkeypatch.setattr(F, "scaled_dot_product_attention", scaled_dot_product_attention)
    q, k, v = leaves(g=4, dtype=torch.bfloat16)
    with capture(tmp_path / "run", backward=True):
        out = F.scaled_dot_product_attention(q, k, v)
        (out.float() ** 2).sum().backward()
    code, report = check(tmp_path / "run")
    assert code == 1
    passed = checks_of(report["cases"][0])
    assert passed["output.close"]
    assert passed["dq.close"]
    assert passed["dv.close"]
    assert not passed["dk.close"]


def test_the_program_s_gradients_are_the_same_bit_for_bit(tmp_path: Path) -> None:
    def grads(backward: bool | None) -> list[Any]:
        q, k, v = leaves(seed=3)
        if backward is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.sum().backward()
        else:
            with capture(tmp_path / str(backward), backward=backward):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                out.sum().backward()
        return [t.grad for t in (q, k, v)]

    plain = grads(None)
    for backward in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(plain, grads(backward), strict=True))


def test_without_backward_nothing_is_hooked(tmp_path: Path) -> None:
    q, k, v = leaves()
    with capture(tmp_path / "run") as cap:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert not out._backward_hooks
        assert not q._backward_hooks
        out.sum().backward()
    assert cap.summary is not None
    assert cap.summary.gradients is None
    assert "gradients" not in cap.summary.line()
    assert not any(key in manifest_of(tmp_path / "run")[0] for key in GRADIENT_KEYS)
    assert "gradients" not in calls_of(tmp_path / "run")[0]


def test_a_forward_pass_alone_lists_no_gradient_and_leaves_no_hook(tmp_path: Path) -> None:
    q, k, v = leaves()
    with capture(tmp_path / "run", backward=True) as cap:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert out._backward_hooks
        assert q._backward_hooks
    assert cap.summary is not None
    assert cap.summary.gradients == 0
    assert "none with gradients (no backward pass reached them)" in cap.summary.line()
    assert "; none with gradients" in (tmp_path / "run/manifest.yaml").read_text()
    file = tmp_path / "run/tensors/00001-call-1.safetensors"
    before = file.read_bytes()
    assert calls_of(tmp_path / "run")[0]["bytes"] == len(before) == cap.summary.bytes
    assert not out._backward_hooks
    assert not q._backward_hooks
    out.sum().backward()  # after the capture: nothing is recorded
    assert file.read_bytes() == before
    assert not any(key in manifest_of(tmp_path / "run")[0] for key in GRADIENT_KEYS)


def test_only_the_inputs_that_require_grad_are_recorded(tmp_path: Path) -> None:
    q, k, v = leaves()
    q.requires_grad_(False)  # frozen: no dQ
    x = torch.randn(1, 2, 6, 8, requires_grad=True)
    with capture(tmp_path / "run", backward=True) as cap:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum().backward()
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        # one tensor as Q, K and V: its gradient is their sum, none of them
        F.scaled_dot_product_attention(x, x, x).sum().backward()
    assert cap.summary is not None
    assert cap.summary.gradients == 2
    frozen, no_grad, same = manifest_of(tmp_path / "run")
    assert [key for key in GRADIENT_KEYS if key in frozen] == ["dout", "expect-dk", "expect-dv"]
    assert not any(key in no_grad or key in same for key in GRADIENT_KEYS)  # dO alone: none
    calls = calls_of(tmp_path / "run")
    assert [c.get("gradients") for c in calls] == [["dout", "dk", "dv"], None, ["dout"]]
    code, report = check(tmp_path / "run")
    assert code == 0, report
    assert "dk.close" in checks_of(report["cases"][0])


def test_k_and_v_shared_by_two_calls_are_left_out_of_both(tmp_path: Path) -> None:
    """Two calls reading one K and V (KV sharing across layers): the gradient a hook on
    K sees is the sum of both calls', neither's own, so neither lists dK or dV, and
    the check of each passes on its own dQ."""
    q1, k, v = leaves()
    q2 = torch.randn(q1.shape, requires_grad=True)
    with capture(tmp_path / "run", backward=True):
        out = F.scaled_dot_product_attention(q1, k, v, enable_gqa=True)
        out = out + F.scaled_dot_product_attention(q2, k, v, enable_gqa=True)
        out.sum().backward()
    calls = calls_of(tmp_path / "run")
    assert [c.get("gradients") for c in calls] == [["dout", "dq"], ["dout", "dq"]]
    code, report = check(tmp_path / "run")
    assert code == 0, [checks_of(case) for case in report["cases"]]
    assert all("dq.close" in checks_of(case) for case in report["cases"])


def test_a_gradient_asked_for_alone_is_kept_when_the_capture_ends(tmp_path: Path) -> None:
    q, k, v = leaves(dtype=torch.bfloat16)
    with capture(tmp_path / "run", backward=True) as cap:
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        (dq,) = torch.autograd.grad(out, [q], torch.ones_like(out))  # dK and dV never come
    assert cap.summary is not None
    assert cap.summary.gradients == 1
    saved = tensors_of(tmp_path / "run/tensors/00001-call-1.safetensors")
    assert torch.equal(saved["dq"], dq)
    (case,) = manifest_of(tmp_path / "run")
    assert [key for key in GRADIENT_KEYS if key in case] == ["dout", "expect-dq"]
    assert check(tmp_path / "run")[0] == 0


def test_a_second_backward_pass_through_the_same_graph_records_nothing_more(
    tmp_path: Path,
) -> None:
    q, k, v = leaves()
    with capture(tmp_path / "run", backward=True):
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        out.sum().backward(retain_graph=True)
        first = (tmp_path / "run/tensors/00001-call-1.safetensors").read_bytes()
        (2 * out).sum().backward()
    assert (tmp_path / "run/tensors/00001-call-1.safetensors").read_bytes() == first


def test_the_documents_list_the_gradients_when_the_backward_pass_ends(tmp_path: Path) -> None:
    """On disk during the capture: a program that ends without unwinding after a
    training step leaves its backward checkable; later calls are appended after."""
    q, k, v = leaves()
    with capture(tmp_path / "run", backward=True):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum().backward()
        assert "dout" in manifest_of(tmp_path / "run")[0]
        assert calls_of(tmp_path / "run")[0]["gradients"] == ["dout", "dq", "dk", "dv"]
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        assert [c["name"] for c in manifest_of(tmp_path / "run")] == ["call-1", "call-2"]
        assert "progress" in (tmp_path / "run/manifest.yaml").read_text().splitlines()[2]
    first, second = manifest_of(tmp_path / "run")
    assert "dout" in first
    assert "dout" not in second


def test_max_bytes_counts_the_gradients_from_the_forward_call(tmp_path: Path) -> None:
    def run(folder: str, max_bytes: int | None = None, backward: bool = True) -> Any:
        q, k, v = leaves()
        with capture(
            tmp_path / folder, max_bytes=max_bytes, backward=backward, notify=lambda _: None
        ) as cap:
            for _ in range(2):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True).sum().backward()
        assert cap.summary is not None
        return cap.summary

    forward, full = run("forward", backward=False).bytes // 2, run("full").bytes // 2
    assert full > forward
    assert run("one", max_bytes=full + forward).captured == 1  # the second's gradients: no room
    assert run("two", max_bytes=2 * full).captured == 2


def test_a_mask_that_requires_grad_has_its_gradient_recorded_not_listed(tmp_path: Path) -> None:
    q, k, v = leaves()
    bias = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with capture(tmp_path / "run", backward=True):
        F.scaled_dot_product_attention(q, k, v, bias, enable_gqa=True).sum().backward()
    saved = tensors_of(tmp_path / "run/tensors/00001-call-1.safetensors")
    assert torch.equal(saved["dmask"], bias.grad)
    assert calls_of(tmp_path / "run")[0]["gradients"] == ["dout", "dq", "dk", "dv", "dmask"]
    (case,) = manifest_of(tmp_path / "run")
    assert [key for key in case if "dmask" in str(case[key])] == []  # no key the check reads
    assert check(tmp_path / "run")[0] == 0


TRAIN = """\
import torch
import torch.nn.functional as F

g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 8, 16, generator=g).requires_grad_(True) for _ in range(3))
F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
print("trained")
"""


def test_sdpa_capture_backward_records_a_script_s_gradients(workdir: Path) -> None:
    Path("train.py").write_text(TRAIN)
    result = invoke("capture", "--out", "run", "--backward", "--", "python", "train.py")
    assert result.exit_code == 0, result.output
    assert result.stdout == "trained\n"
    assert result.stderr.startswith("sdpa capture: 1 of 1 attention call captured (")
    assert ", 1 with its gradients; check them: sdpa check --manifest run/manifest.yaml" in (
        result.stderr
    )
    assert "dout" in manifest_of(Path("run"))[0]
    assert invoke("check", "--manifest", "run/manifest.yaml").exit_code == 0
    plain = invoke("capture", "--out", "plain", "--", "python", "train.py")
    assert "gradients" not in plain.stderr
