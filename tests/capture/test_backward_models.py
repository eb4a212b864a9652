"""Real models' backward passes: a training step (forward, loss, backward) of tiny randomly
initialised Hugging Face models captured with `backward=True`, every call's forward and
backward judged by `sdpa check --manifest` with its default settings; then one layer's
backward broken (dK twice too large), and the check names that layer and dk alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from captured import SIZES, check, failures

from sdpa_cli.capture import capture

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Function: Any = torch.autograd.Function

BATCH, LENGTH = 2, 20
LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
BACKWARD_CHECKS = {"dq.close", "dk.close", "dv.close", "dv.sums"}


def llama(dtype: str, implementation: str = "eager", **extra: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SIZES, **extra})
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).train()
    model.set_attn_implementation(implementation)
    return model


def ids() -> Any:
    return torch.randint(0, 128, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))


def train_step(model: Any, **inputs: Any) -> list[Any]:
    """Forward, the loss, backward: the parameters' gradients."""
    tokens = ids()
    model.zero_grad(set_to_none=True)
    model(input_ids=tokens, labels=tokens, **inputs).loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def checked(case: dict[str, Any]) -> set[str]:
    return {c["name"] for c in case["checks"]}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_training_step_checks_forward_and_backward_and_passes(
    implementation: str, dtype: str, tmp_path: Path
) -> None:
    model = llama(dtype, implementation)
    plain = train_step(model)
    with capture(tmp_path / "run", backward=True) as cap:
        during = train_step(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, during, strict=True))  # bit for bit
    assert cap.summary is not None
    assert cap.summary.gradients == 2
    cases = yaml.safe_load((tmp_path / "run/manifest.yaml").read_text())["cases"]
    for case in cases:
        assert {"dout", "expect-dq", "expect-dk", "expect-dv"} <= set(case)
    code, report = check(tmp_path / "run")
    assert [c["name"] for c in report["cases"]] == LAYERS
    assert all(checked(case) >= BACKWARD_CHECKS for case in report["cases"])
    assert code == 0, failures(report)


def test_eager_dout_is_recorded_as_the_output_is(tmp_path: Path) -> None:
    """(B, H, L, Ev), transposed from the (B, L, H, Ev) eager attention returns; dK and
    dV as K and V before repeat_kv (2 heads for 4)."""
    from sdpa_cli.files.loaders import load_array

    with capture(tmp_path / "run", backward=True):
        train_step(llama("float32"))
    file = tmp_path / "run/tensors/00001-model.layers.0.self_attn.safetensors"
    shapes = {n: load_array(f"{file}:{n}").shape for n in ("output", "dout", "k", "dk", "dv")}
    assert shapes["dout"] == shapes["output"] == (BATCH, 4, LENGTH, 16)
    assert shapes["dk"] == shapes["dv"] == shapes["k"] == (BATCH, 2, LENGTH, 16)


def test_a_broken_backward_in_one_layer_fails_that_layer_naming_dk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.llama import modeling_llama

    model = llama("bfloat16")
    target = model.model.layers[1].self_attn
    eager = modeling_llama.eager_attention_forward

    class DoubledDK(Function):  # type: ignore[misc]
        """The real eager attention forward; its backward with dK twice too large."""

        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, mask: Any, scaling: float) -> Any:
            ctx.save_for_backward(q, k, v)
            ctx.mask, ctx.scaling = mask, scaling
            return eager(target, q, k, v, mask, scaling=scaling)[0]

        @staticmethod
        def backward(ctx: Any, dout: Any) -> Any:
            with torch.enable_grad():
                q, k, v = (t.detach().requires_grad_(True) for t in ctx.saved_tensors)
                out = eager(target, q, k, v, ctx.mask, scaling=ctx.scaling)[0]
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
            return dq, 2 * dk, dv, None, None

    def eager_attention_forward(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        scaling: float,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> Any:
        if module is not target:
            return eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        return DoubledDK.apply(query, key, value, attention_mask, scaling), None

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", eager_attention_forward)
    with capture(tmp_path / "run", backward=True):
        train_step(model)
    code, report = check(tmp_path / "run")
    assert code == 1
    assert [(c["name"], c["passed"]) for c in report["cases"]] == [
        (LAYERS[0], True),
        (LAYERS[1], False),
    ]
    assert [(name, check) for name, check, _ in failures(report)] == [(LAYERS[1], "dk.close")]


def test_a_softcapped_model_s_backward_passes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        **SIZES,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=64,
        attn_logit_softcapping=2.0,
    )
    model = transformers.Gemma2ForCausalLM(config).to(torch.bfloat16).train()
    model.set_attn_implementation("eager")
    with capture(tmp_path / "run", backward=True):
        train_step(model)
    code, report = check(tmp_path / "run")
    cases = yaml.safe_load((tmp_path / "run/manifest.yaml").read_text())["cases"]
    assert all(c["softcap"] == 2.0 and "expect-dk" in c for c in cases)
    assert all(checked(case) >= BACKWARD_CHECKS for case in report["cases"])
    assert code == 0, failures(report)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_records_the_call_whose_gradients_come(
    reentrant: bool, tmp_path: Path
) -> None:
    """Each layer's attention runs twice, the second time in the backward pass to
    recompute what was not kept: the forward call's gradients come (non-reentrant), or
    the recomputed call's (reentrant: the forward ran without grad)."""
    model = llama("float32")
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers ≥ 5.x's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    with capture(tmp_path / "run", backward=True) as cap:
        train_step(model, use_cache=False)
    assert cap.summary is not None
    assert (cap.summary.captured, cap.summary.gradients) == (4, 2)
    calls = yaml.safe_load((tmp_path / "run/calls.yaml").read_text())["calls"]
    graded = [bool(c.get("gradients")) for c in calls]
    assert graded == ([False, False, True, True] if reentrant else [True, True, False, False])
    code, report = check(tmp_path / "run")
    assert code == 0, failures(report)


def test_a_left_padded_training_batch_passes(tmp_path: Path) -> None:
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, :5] = 0
    with capture(tmp_path / "run", backward=True):
        train_step(llama("float32"), attention_mask=mask)
    code, report = check(tmp_path / "run")
    assert code == 0, failures(report)
