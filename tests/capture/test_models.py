"""Real models in: tiny randomly initialised Hugging Face models (built from configs, no
download) captured in one forward pass, and every call judged by `sdpa check --manifest`
with its default settings; then one layer's attention broken, and the check names it.

Llama (grouped-query heads, a left-padded batch), Gemma 2 (softcap, a sliding and a
global layer, a scale other than 1/√E), Mistral (sliding window) and BERT (bidirectional,
padded) run their eager attention; GPT-2 runs attn_implementation="sdpa", which ends in
torch's SDPA. Each in float32 and bfloat16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from captured import SIZES, check, failures

from sdpa_cli.capture import capture

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BATCH, LENGTH, PADDING = 2, 20, 5
WINDOW = 8  # shorter than LENGTH: the sliding window hides keys
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Tiny:
    """A tiny model: how to build it, its attention modules' paths, its padding side."""

    build: Callable[[], Any]
    paths: tuple[str, ...]
    left_padding: bool = True


def _causal_lm(config: str, model: str, **extra: Any) -> Callable[[], Any]:
    def build() -> Any:
        cfg = getattr(transformers, config)(**{**SIZES, **extra})
        return getattr(transformers, model)(cfg)

    return build


def _gpt2() -> Any:
    cfg = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.1
    )
    cfg.bos_token_id = cfg.eos_token_id = 0
    return transformers.GPT2LMHeadModel(cfg)


def _bert() -> Any:
    sizes = {k: v for k, v in SIZES.items() if k != "num_key_value_heads"}
    return transformers.BertModel(transformers.BertConfig(**sizes), add_pooling_layer=False)


DECODER = tuple(f"model.layers.{i}.self_attn" for i in range(2))
MODELS: dict[str, tuple[Tiny, str]] = {
    "llama": (Tiny(_causal_lm("LlamaConfig", "LlamaForCausalLM"), DECODER), "eager"),
    "gemma2": (
        Tiny(
            _causal_lm(
                "Gemma2Config",
                "Gemma2ForCausalLM",
                head_dim=16,
                sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                query_pre_attn_scalar=64,  # scale 1/8, where 1/√E is 1/4
                attn_logit_softcapping=2.0,  # small enough to bite on a tiny model's logits
                initializer_range=0.2,
            ),
            DECODER,
        ),
        "eager",
    ),
    "mistral": (
        Tiny(_causal_lm("MistralConfig", "MistralForCausalLM", sliding_window=WINDOW), DECODER),
        "eager",
    ),
    "gpt2": (Tiny(_gpt2, ("transformer.h.0.attn", "transformer.h.1.attn")), "sdpa"),
    "bert": (
        Tiny(
            _bert,
            ("encoder.layer.0.attention.self", "encoder.layer.1.attention.self"),
            left_padding=False,
        ),
        "eager",
    ),
}


def model(name: str, dtype: str, seed: int = 0) -> Any:
    tiny, implementation = MODELS[name]
    torch.manual_seed(seed)
    built = tiny.build().to(getattr(torch, dtype)).eval()
    built.set_attn_implementation(implementation)
    return built


def batch(name: str) -> dict[str, Any]:
    """Token ids and a padding mask: item 1 padded on the left (right for BERT)."""
    ids = torch.randint(0, 128, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if MODELS[name][0].left_padding:
        mask[1, :PADDING] = 0
    else:
        mask[1, -PADDING:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def first_output(out: Any) -> Any:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@functools.cache
def captured(name: str, dtype: str, root: Path) -> tuple[Path, Any, Any]:
    """One forward pass without and one with a capture: the capture's folder and both
    outputs."""
    net, inputs = model(name, dtype), batch(name)
    folder = root / f"{name}-{dtype}"
    with torch.no_grad():
        plain = first_output(net(**inputs))
        with capture(folder):
            during = first_output(net(**inputs))
    return folder, plain, during


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("captures")


def calls_of(folder: Path) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = yaml.safe_load((folder / "calls.yaml").read_text())["calls"]
    return calls


# --- every call passes ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_call_of_a_real_model_passes_check(name: str, dtype: str, root: Path) -> None:
    folder, plain, during = captured(name, dtype, root)
    assert torch.equal(plain, during)  # the capture changes nothing, bit for bit
    code, report = check(folder)
    assert [c["name"] for c in report["cases"]] == list(MODELS[name][0].paths)
    function = {"eager": "eager_attention_forward", "sdpa": "scaled_dot_product_attention"}
    assert {c["source"].rsplit(".", 1)[1] for c in calls_of(folder)} == {function[MODELS[name][1]]}
    assert all(c["error"] is None for c in report["cases"]), report["cases"]
    assert code == 0, failures(report)  # float32 and bfloat16 alike, by default


def test_what_each_model_passes_is_recorded(root: Path) -> None:
    folder = captured("gemma2", "bfloat16", root)[0]
    sliding, full = calls_of(folder)
    assert sliding["sliding_window"] == WINDOW  # informational: the mask holds the window
    assert "sliding_window" not in full
    assert sliding["options"] == {"scale": 0.125, "softcap": 2.0}
    assert sliding["dtype"] == "bfloat16"
    assert sliding["mask"].startswith("additive (bfloat16")
    assert sliding["source"] == "transformers.models.gemma2.modeling_gemma2.eager_attention_forward"

    llama = calls_of(captured("llama", "bfloat16", root)[0])
    assert [c["layer"] for c in llama] == [0, 1]
    assert "K and V with 2 heads for Q's 4 (grouped-query)" in llama[0]["layout"]
    assert llama[0]["options"] == {"scale": 0.25}

    (gpt2, _) = calls_of(captured("gpt2", "bfloat16", root)[0])
    assert gpt2["source"] == "torch.nn.functional.scaled_dot_product_attention"
    assert gpt2["mask"].startswith("boolean")  # the padding, as transformers gives it to sdpa


def test_the_sliding_window_in_the_mask_is_sdpa_s_causal_window_w_minus_1(root: Path) -> None:
    from sdpa_cli.files.loaders import load_array

    folder = captured("mistral", "bfloat16", root)[0]
    call = calls_of(folder)[0]
    assert call["sliding_window"] == WINDOW
    mask = load_array(f"{folder / call['file']}:mask", name="mask")  # (B, 1, L, S)
    i, j = np.arange(LENGTH)[:, None], np.arange(LENGTH)[None, :]
    # sdpa's --causal --window W-1,0: −(W − 1) ≤ j − i ≤ 0
    assert np.array_equal(mask[0, 0] == 0, (j <= i) & (i - j <= WINDOW - 1))  # item 0: no padding


# --- a broken layer is found -------------------------------------------------------------


def test_a_broken_head_in_one_eager_layer_fails_and_is_named(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.models.llama import modeling_llama

    net, inputs = model("llama", "bfloat16"), batch("llama")
    target = net.model.layers[1].self_attn
    eager = modeling_llama.eager_attention_forward

    def eager_attention_forward(module: Any, *args: Any, **kwargs: Any) -> Any:
        out, weights = eager(module, *args, **kwargs)
        if module is target:  # layer 1, head 1: 5% too large
            out = out.clone()
            out[:, :, 1] *= 1.05
        return out, weights

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", eager_attention_forward)
    folder = root / "llama-broken-head"
    with torch.no_grad(), capture(folder):
        net(**inputs)
    code, report = check(folder)
    assert code == 1
    good, bad = report["cases"]
    assert (good["name"], good["passed"]) == ("model.layers.0.self_attn", True)
    assert (bad["name"], bad["passed"]) == ("model.layers.1.self_attn", False)
    close = next(c for c in bad["checks"] if c["name"] == "output.close")
    assert not close["passed"]
    assert "the error is in slice [" in close["summary"]  # (batch, head)
    assert close["outlier_slices"]
    assert {s["index"][1] for s in close["outlier_slices"]} == {1}
    assert next(c for c in bad["checks"] if c["name"] == "weights.close")["passed"]


def test_a_wrong_scale_in_one_sdpa_layer_fails_with_its_hint(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    net, inputs = model("gpt2", "bfloat16"), batch("gpt2")
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention
    broken = {"on": False}

    def scaled_dot_product_attention(q: Any, *args: Any, **kwargs: Any) -> Any:
        if broken["on"]:  # 1/E where 1/√E was asked
            kwargs["scale"] = 1.0 / q.shape[-1]
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", scaled_dot_product_attention)
    layer = net.transformer.h[0].attn
    layer.register_forward_pre_hook(lambda *_: broken.update(on=True))
    layer.register_forward_hook(lambda *_: broken.update(on=False))
    folder = root / "gpt2-broken-scale"
    with torch.no_grad(), capture(folder):
        net(**inputs)
    code, report = check(folder)
    assert code == 1
    assert [(c["name"], c["passed"]) for c in report["cases"]] == [
        ("transformer.h.0.attn", False),
        ("transformer.h.1.attn", True),
    ]
    close = next(c for c in report["cases"][0]["checks"] if c["name"] == "output.close")
    assert "--scale dk" in (close["hint"] or "")
