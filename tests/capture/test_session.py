"""Tests of the capture on plain PyTorch calls and a stand-in transformers module: what is
caught and put back, the options recorded, the names, the bounds, and the manifest
`sdpa check` runs (no transformers needed here; tests/capture/test_models.py has the
real models)."""

from __future__ import annotations

import json
import math
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from clirunner import invoke

from sdpa_cli.capture import INSTALL_TORCH, capture
from sdpa_cli.errors import InputError, SpecError

torch = pytest.importorskip("torch")
F = torch.nn.functional
Module: Any = torch.nn.Module


def qkv(
    *shape: int, heads_kv: int | None = None, seed: int = 0, dtype: Any = None
) -> tuple[Any, Any, Any]:
    """Q (B, H, L, E) and K, V (B, G, L, E) of standard normal values (float32 unless
    ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    b, h, n, e = shape
    kv = (b, heads_kv or h, n, e)
    return tuple(torch.randn(s, generator=g).to(dtype or torch.float32) for s in (shape, kv, kv))


def manifest_of(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((folder / "manifest.yaml").read_text())
    return data


def calls_of(folder: Path) -> list[dict[str, Any]]:
    data: dict[str, Any] = yaml.safe_load((folder / "calls.yaml").read_text())
    calls: list[dict[str, Any]] = data["calls"]
    return calls


def check(folder: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    """`sdpa check --manifest` on the capture: exit code and JSON report."""
    result = invoke(
        "check",
        "--manifest",
        str(folder / "manifest.yaml"),
        "--jobs",
        "1",
        "--format",
        "json",
        *flags,
    )
    assert result.exit_code in (0, 1), result.output
    report: dict[str, Any] = json.loads(result.stdout)
    return result.exit_code, report


# --- torch's SDPA -------------------------------------------------------------------------


def test_every_torch_call_is_recorded_with_its_options_and_passes_check(tmp_path: Path) -> None:
    # bfloat16: float32 exports of real kernels fail check's default judgement (see
    # test_models.py's FLOAT32_FACTOR)
    q, k, v = qkv(2, 4, 6, 8, heads_kv=2, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True  # no row fully hidden
    additive = torch.zeros(6, 6, dtype=q.dtype).masked_fill(~mask[0, 0], torch.finfo(q.dtype).min)
    with capture(tmp_path / "run") as cap:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        F.scaled_dot_product_attention(q, k4, v4, attn_mask=mask, scale=0.3)
        F.scaled_dot_product_attention(q, q, q, additive)
    assert cap.summary is not None
    assert (cap.summary.seen, cap.summary.captured, cap.summary.skipped) == (3, 3, 0)
    cases = manifest_of(tmp_path / "run")["cases"]
    assert [c["name"] for c in cases] == ["call-1", "call-2", "call-3"]
    assert cases[0]["causal"] is True
    assert "scale" not in cases[0]  # None: sdpa's default 1/√E, as torch's
    assert cases[1]["scale"] == 0.3
    assert cases[1]["mask"] == "tensors/00002-call-2.safetensors:mask"
    assert "causal" not in cases[1]
    assert cases[2]["expect-output"] == "tensors/00003-call-3.safetensors:output"
    calls = calls_of(tmp_path / "run")
    assert calls[0]["enable_gqa"] is True
    assert "grouped-query" in calls[0]["layout"]
    assert calls[1]["mask"].startswith("boolean")
    assert calls[2]["mask"].startswith("additive")
    assert calls[0]["source"] == "torch.nn.functional.scaled_dot_product_attention"
    code, report = check(tmp_path / "run")
    assert code == 0, [c["checks"] for c in report["cases"]]


def test_the_patch_is_put_back_even_on_an_exception(tmp_path: Path) -> None:
    original = F.scaled_dot_product_attention

    def attend_then_fail() -> None:
        with capture(tmp_path / "run"):
            assert F.scaled_dot_product_attention is not original
            F.scaled_dot_product_attention(*qkv(1, 1, 2, 2))
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        attend_then_fail()
    assert F.scaled_dot_product_attention is original
    assert calls_of(tmp_path / "run")[0]["name"] == "call-1"  # what was caught is written


def test_captures_do_not_nest(tmp_path: Path) -> None:
    with capture(tmp_path / "a"), pytest.raises(SpecError, match="captures do not nest"):  # noqa: SIM117
        with capture(tmp_path / "b"):
            pass
    with capture(tmp_path / "c"):  # the refusal left nothing running
        pass


def test_outputs_are_the_same_bit_for_bit(tmp_path: Path) -> None:
    q, k, v = qkv(2, 4, 16, 8, heads_kv=2, seed=3)
    before = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with capture(tmp_path / "run"):
        during = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(before, during)


def test_dropout_is_kept_out_of_the_manifest_with_the_reason(tmp_path: Path) -> None:
    q, k, v = qkv(1, 2, 4, 4)
    with capture(tmp_path / "run") as cap:
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
        F.scaled_dot_product_attention(q, k, v)
    assert cap.summary is not None
    assert cap.summary.skipped == 1
    assert "1 not replayable (see calls.yaml)" in cap.summary.line()
    assert [c["name"] for c in manifest_of(tmp_path / "run")["cases"]] == ["call-2"]
    skipped = calls_of(tmp_path / "run")[0]
    assert skipped["skipped"] == "dropout_p 0.5: its random mask cannot be replayed"
    assert skipped["file"] == "tensors/00001-call-1.safetensors"


def test_a_call_inside_a_module_is_named_by_its_path(tmp_path: Path) -> None:
    class Attention(Module):  # type: ignore[misc]
        def forward(self, x: Any) -> Any:
            return F.scaled_dot_product_attention(x, x, x)

    class Model(Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Attention(), Attention()])

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = block(x)
            return self.blocks[1](x)

    model = Model()
    with capture(tmp_path / "run"):
        model(torch.ones(1, 2, 3, 4))
        Attention()(torch.ones(1, 2, 3, 4))  # the outermost module itself
    calls = calls_of(tmp_path / "run")
    names = [c["name"] for c in calls]
    assert names == ["blocks.0", "blocks.1", "blocks.1#2", "Attention"]
    assert [c["layer"] for c in calls] == [0, 1, 1, None]
    assert calls[2]["file"] == "tensors/00003-blocks.1_2.safetensors"


# --- transformers' eager attention, a stand-in module --------------------------------------


def eager_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """transformers' eager attention, as Llama's; it calls torch's SDPA for the output,
    which the capture must not record a second time."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask
    weights = torch.softmax(scores, dim=-1)
    out = F.scaled_dot_product_attention(query, key, value, attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), weights


@pytest.fixture
def fake_modeling() -> Iterator[types.ModuleType]:
    """``transformers.models.fake.modeling_fake`` with an eager attention, imported."""
    module = types.ModuleType("transformers.models.fake.modeling_fake")
    module.eager_attention_forward = eager_attention_forward  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


class FakeAttention(Module):  # type: ignore[misc]
    """Calls the eager attention through its module's globals, as transformers does."""

    def __init__(self, modeling: types.ModuleType, layer_idx: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.modeling, self.layer_idx, self.dropout = modeling, layer_idx, dropout

    def forward(self, q: Any, k: Any, v: Any, mask: Any) -> Any:
        out, _ = self.modeling.eager_attention_forward(
            self, q, k, v, mask, scaling=0.25, dropout=self.dropout, sliding_window=3
        )
        return out


def test_eager_attention_is_recorded_once_with_its_weights(
    tmp_path: Path, fake_modeling: types.ModuleType
) -> None:
    q, k, v = qkv(2, 2, 5, 16, dtype=torch.bfloat16)
    causal = torch.full((5, 5), torch.finfo(q.dtype).min, dtype=q.dtype).triu(1)[None, None]
    layer = FakeAttention(fake_modeling, layer_idx=7)
    with capture(tmp_path / "run") as cap:
        assert fake_modeling.eager_attention_forward is not eager_attention_forward
        out = layer(q, k, v, causal)
    assert fake_modeling.eager_attention_forward is eager_attention_forward
    assert cap.summary is not None
    assert cap.summary.seen == 1  # the SDPA call inside the eager one is not a second call
    (call,) = calls_of(tmp_path / "run")
    assert call["source"] == f"{__name__}.eager_attention_forward"
    assert call["name"] == "FakeAttention"
    assert call["layer"] == 7  # no path: the module's layer_idx
    assert call["sliding_window"] == 3
    (case,) = manifest_of(tmp_path / "run")["cases"]
    assert case["scale"] == 0.25
    assert "causal" not in case  # the mask holds causality and the window
    assert "window" not in case
    assert set(case) >= {"mask", "expect-output", "expect-weights"}
    assert torch.equal(out, layer(q, k, v, causal))
    code, report = check(tmp_path / "run")
    assert code == 0, report["cases"][0]["checks"]


def test_a_transformers_module_imported_during_the_capture_is_patched(tmp_path: Path) -> None:
    module = types.ModuleType("transformers.models.late.modeling_late")
    module.eager_attention_forward = eager_attention_forward  # type: ignore[attr-defined]
    q, k, v = qkv(1, 2, 3, 4)
    with capture(tmp_path / "run") as cap:
        sys.modules[module.__name__] = module  # a script importing transformers
        try:
            FakeAttention(module, 0)(q, k, v, torch.zeros(3, 3))
        finally:
            del sys.modules[module.__name__]
    assert module.eager_attention_forward is eager_attention_forward
    assert cap.summary is not None
    assert cap.summary.captured == 1
    assert calls_of(tmp_path / "run")[0]["source"].endswith("eager_attention_forward")


def test_a_patched_function_imported_by_a_later_module_is_put_back_as_the_original(
    tmp_path: Path, fake_modeling: types.ModuleType
) -> None:
    later = types.ModuleType("transformers.models.later.modeling_later")
    q, k, v = qkv(1, 2, 3, 4)
    with capture(tmp_path / "run") as cap:
        # from ..fake.modeling_fake import eager_attention_forward, during the capture
        later.eager_attention_forward = fake_modeling.eager_attention_forward  # type: ignore[attr-defined]
        sys.modules[later.__name__] = later
        try:
            FakeAttention(later, 0)(q, k, v, torch.zeros(3, 3))
        finally:
            del sys.modules[later.__name__]
    assert cap.summary is not None
    assert cap.summary.seen == 1
    assert later.eager_attention_forward is eager_attention_forward
    assert fake_modeling.eager_attention_forward is eager_attention_forward


def test_eager_dropout_counts_only_in_training(
    tmp_path: Path, fake_modeling: types.ModuleType
) -> None:
    layer = FakeAttention(fake_modeling, 0, dropout=0.1)
    q, k, v = qkv(1, 2, 3, 4)
    with capture(tmp_path / "run"):
        layer.eval()(q, k, v, torch.zeros(3, 3))
        layer.train()(q, k, v, torch.zeros(3, 3))
    calls = calls_of(tmp_path / "run")
    assert [c.get("skipped") for c in calls] == [
        None,
        "dropout 0.1 in training: its random mask cannot be replayed",
    ]


# --- the bounds -----------------------------------------------------------------------------


def run_calls(folder: Path, n: int, **bounds: Any) -> list[str]:
    """``n`` calls of torch's SDPA under a capture with ``bounds``; the names recorded."""
    q, k, v = qkv(1, 2, 4, 8)
    with capture(folder, **bounds):
        for _ in range(n):
            F.scaled_dot_product_attention(q, k, v)
    return [c["name"] for c in calls_of(folder)]


def test_every_match_and_max_calls_pick_the_calls(tmp_path: Path) -> None:
    assert run_calls(tmp_path / "a", 7, every=3) == ["call-1", "call-4", "call-7"]
    assert run_calls(tmp_path / "b", 12, match="call-1*") == [
        "call-1",
        "call-10",
        "call-11",
        "call-12",
    ]
    assert run_calls(tmp_path / "c", 12, match="-1") == ["call-1", "call-10", "call-11", "call-12"]
    assert run_calls(tmp_path / "d", 12, match="call-1?", every=2) == ["call-10", "call-12"]
    assert run_calls(tmp_path / "e", 5, max_calls=2) == ["call-1", "call-2"]


def test_the_byte_budget_stops_the_capture_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    q, k, v = qkv(1, 2, 4, 8)
    with capture(tmp_path / "probe"):
        F.scaled_dot_product_attention(q, k, v)
    size = calls_of(tmp_path / "probe")[0]["bytes"]
    capsys.readouterr()
    with capture(tmp_path / "run", max_bytes=int(2.5 * size)) as cap:
        for _ in range(5):
            F.scaled_dot_product_attention(q, k, v)
    assert cap.summary is not None
    assert (cap.summary.seen, cap.summary.captured, cap.summary.bytes) == (5, 2, 2 * size)
    assert cap.summary.stopped is not None
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("sdpa capture: stopped at 2 calls (")
    assert "call 3 (call-3, " in err
    assert err.rstrip().endswith("; later calls are not captured")
    assert "stopped by max_bytes" in cap.summary.line()
    assert len(list((tmp_path / "run" / "tensors").glob("*.safetensors"))) == 2
    assert len(manifest_of(tmp_path / "run")["cases"]) == 2


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"every": 0}, "every: must be a positive integer, got 0"),
        ({"max_calls": 1.5}, "max_calls: must be a positive integer, got 1.5"),
        ({"max_bytes": True}, "max_bytes: must be a positive integer, got True"),
    ],
)
def test_bad_bounds_are_named(tmp_path: Path, bounds: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as caught:
        capture(tmp_path, **bounds)
    assert str(caught.value) == message


def test_nothing_captured_writes_no_manifest(tmp_path: Path) -> None:
    with capture(tmp_path / "run") as cap:
        pass
    assert cap.summary is not None
    assert cap.summary.manifest is None
    assert (
        cap.summary.line() == "no attention call captured (0 calls seen); nothing written to check"
    )
    assert not (tmp_path / "run" / "manifest.yaml").exists()
    assert calls_of(tmp_path / "run") == []


def test_a_folder_holding_a_capture_is_refused(tmp_path: Path) -> None:
    run_calls(tmp_path / "run", 1)
    with pytest.raises(InputError, match="already holds a capture"):
        capture(tmp_path / "run").__enter__()
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match="is a file; expected a directory"):
        capture(tmp_path / "file").__enter__()


def test_without_torch_the_capture_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(SpecError) as caught, capture(tmp_path / "run"):
        pass
    assert str(caught.value) == (
        f"capture: needs PyTorch, which is not installed; install it with {INSTALL_TORCH}"
    )
    assert not (tmp_path / "run").exists()


def test_a_scale_sdpa_cannot_take_is_not_replayed(tmp_path: Path) -> None:
    q, k, v = qkv(1, 1, 2, 4)
    with capture(tmp_path / "run"):
        F.scaled_dot_product_attention(q, k, v, scale=-1.0)
    (call,) = calls_of(tmp_path / "run")
    assert call["skipped"] == "scale -1.0: sdpa takes a positive finite scale"
    assert math.isclose(call["dropout"], 0.0)
