"""Two runs of a real model compared (`sdpa diff`): a random-init tiny Llama (built
from a config, nothing downloaded) captured in eager float32 and in SDPA bfloat16 on
the same left-padded batch names no divergence, with a margin; the same run with a
rotary embedding turned the wrong way in layer 2 names layer 2, upstream of
attention; with layer 1's kernel scaling by 1/d_k it names layer 1, in the kernel."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from captured import SIZES
from clirunner import invoke

from sdpa_cli.capture import capture
from sdpa_cli.check.diff import BOUND
from sdpa_cli.errors import ExitCode

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYERS, LENGTH, PADDING = 4, 16, 5
NAMES = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]


def llama(dtype: str, attention: str) -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SIZES, "num_hidden_layers": LAYERS})
    net = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    net.set_attn_implementation(attention)
    return net


def batch() -> dict[str, Any]:
    ids = torch.randint(0, 128, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :PADDING] = 0  # item 1 left-padded: its padded positions differ freely
    return {"input_ids": ids, "attention_mask": mask}


def captured(folder: Path, net: Any) -> Path:
    with torch.no_grad(), capture(folder):
        net(**batch())
    return folder


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("diff")


@pytest.fixture(scope="module")
def eager_float32(root: Path) -> Path:
    return captured(root / "eager-float32", llama("float32", "eager"))


def diff(a: Path, b: Path) -> tuple[int, dict[str, Any]]:
    result = invoke("diff", str(a), str(b), "--format", "json", "--jobs", "1")
    assert result.exit_code in (ExitCode.OK, ExitCode.CHECK_FAILED), result.output
    document: dict[str, Any] = json.loads(result.stdout)
    return result.exit_code, document


def units(document: dict[str, Any], call: int, *names: str) -> list[float]:
    found = document["calls"][call]["differences"]
    return [found[n]["units"] for n in names]


def test_eager_float32_and_sdpa_bfloat16_name_no_divergence(eager_float32: Path) -> None:
    b = captured(eager_float32.parent / "sdpa-bfloat16", llama("bfloat16", "sdpa"))
    code, document = diff(eager_float32, b)
    assert code == ExitCode.OK, document["conclusion"]
    assert document["first"] is None
    assert document["pairing"] == {"by": "name", "pairs": LAYERS, "only_a": [], "only_b": []}
    assert [c["a"] for c in document["calls"]] == NAMES
    assert all(c["kernel"]["passed"] for c in document["calls"])
    # the padded queries of item 1 (and the keys only they see) are left out
    assert {c["rows"] for c in document["calls"]} == {(2 * LENGTH - PADDING) * 4}
    largest = max(u for i in range(LAYERS) for u in units(document, i, "q", "k", "v"))
    assert 1 < largest < BOUND / 4  # measured 5.1u: rounding carried layer to layer


def rotary_turned_back(layer: int) -> Callable[..., Any]:
    """A forward pre-hook that turns the layer's rotary embedding the wrong way."""

    def hook(_module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        cos, sin = kwargs["position_embeddings"]
        return args, {**kwargs, "position_embeddings": (cos, -sin)}

    return hook


def test_a_rotary_bug_in_one_layer_is_named_upstream_of_attention(eager_float32: Path) -> None:
    net = llama("bfloat16", "sdpa")
    net.model.layers[2].self_attn.register_forward_pre_hook(rotary_turned_back(2), with_kwargs=True)
    b = captured(eager_float32.parent / "rotary-bug", net)
    code, document = diff(eager_float32, b)
    assert code == ExitCode.CHECK_FAILED
    assert document["first"] == {"a": NAMES[2], "b": NAMES[2], "where": "upstream"}
    assert document["calls"][2]["differ"] == ["q", "k"]
    q, k, v = units(document, 2, "q", "k", "v")
    assert min(q, k) > 2 * BOUND  # measured 286u, 291u
    assert v < BOUND / 4  # V takes no rotary embedding
    assert document["conclusion"].startswith(
        f"first divergence: {NAMES[2]} — upstream of attention (Q, K differ by "
    )
    assert document["conclusion"].endswith("; V agrees)")


def test_a_kernel_bug_in_one_call_is_named_in_the_kernel(
    eager_float32: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention
    broken = {"on": False}

    def scaled_dot_product_attention(q: Any, *args: Any, **kwargs: Any) -> Any:
        if broken["on"]:  # 1/E where 1/√E was asked
            kwargs["scale"] = 1.0 / q.shape[-1]
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(functional, "scaled_dot_product_attention", scaled_dot_product_attention)
    net = llama("bfloat16", "sdpa")
    layer = net.model.layers[1].self_attn
    layer.register_forward_pre_hook(lambda *_: broken.update(on=True))
    layer.register_forward_hook(lambda *_: broken.update(on=False))
    b = captured(eager_float32.parent / "kernel-bug", net)
    code, document = diff(eager_float32, b)
    assert code == ExitCode.CHECK_FAILED
    assert document["first"] == {"a": NAMES[1], "b": NAMES[1], "where": "kernel"}
    call = document["calls"][1]
    assert call["differ"] == []
    assert call["kernel"]["check"] == "output.close"
    assert max(units(document, 1, "q", "k", "v")) < BOUND / 4
    assert "B's output fails against its own inputs: output.close" in document["conclusion"]
