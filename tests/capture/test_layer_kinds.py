"""Layer schedules: Llama 4's chunked and global layers, Gemma 3's sliding and global
layers, from tiny randomly initialised models (configs, no download), captured in
float64. Each call records its layer kind, and its case the options that say it
(``--attention-chunk``, ``--window``, causal): sdpa computes each layer's output from
those options alone, the mask Hugging Face built left out, as it does with the mask
(at 1e-12), and as the model's kernel did; a padded batch,
whose mask hides more, keeps the mask alone and says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from sdpa_cli.capture import capture
from sdpa_cli.engine.options import parse_options
from sdpa_cli.engine.spec import build_spec
from sdpa_cli.engine.trace import trace
from sdpa_cli.files.loaders import load_array

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LENGTH, CHUNK, WINDOW = 11, 4, 3
SIZES: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "initializer_range": 0.2,
}


def llama4() -> Any:
    config = transformers.Llama4TextConfig(
        **SIZES,
        intermediate_size_mlp=64,
        num_hidden_layers=4,
        attention_chunk_size=CHUNK,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    return transformers.Llama4ForCausalLM(config)


def gemma3() -> Any:
    config = transformers.Gemma3TextConfig(
        **SIZES,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    return transformers.Gemma3ForCausalLM(config)


BUILD = {"llama4": llama4, "gemma3": gemma3}


def captured(name: str, folder: Path, padded: bool = False) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = BUILD[name]().to(torch.float64).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(0, 64, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    with torch.no_grad(), capture(folder):
        model(input_ids=ids, attention_mask=mask)
    calls: list[dict[str, Any]] = yaml.safe_load((folder / "calls.yaml").read_text())["calls"]
    return calls


def outputs(folder: Path, call: dict[str, Any]) -> tuple[Any, Any, Any]:
    """sdpa's output from the call's Q, K, V and its case's options with no mask; from
    them and the mask the kernel got; and the output the kernel returned."""
    read = {n: load_array(f"{folder / call['file']}:{n}", name=n) for n in ("q", "k", "v")}
    options = parse_options(call["options"])
    alone = build_spec(read["q"], read["k"], read["v"], options=options)
    mask = load_array(f"{folder / call['file']}:mask", name="mask")
    both = build_spec(read["q"], read["k"], read["v"], mask=mask, options=options)
    kernel = load_array(f"{folder / call['file']}:output", name="output")
    return trace(alone, stages=("output",)).output, trace(both, stages=("output",)).output, kernel


def agree(folder: Path, call: dict[str, Any]) -> None:
    """The options alone give what the mask gives, at 1e-12, and the kernel's output
    within its float32 softmax's rounding (Hugging Face's eager softmax is float32)."""
    alone, masked, kernel = outputs(folder, call)
    np.testing.assert_allclose(alone, masked, rtol=0, atol=1e-12, err_msg=call["name"])
    np.testing.assert_allclose(alone, kernel, rtol=0, atol=1e-5, err_msg=call["name"])


def test_llama4s_chunked_layers_are_attention_chunk(tmp_path: Path) -> None:
    calls = captured("llama4", tmp_path)
    kinds = [c["layer_kind"] for c in calls]
    assert kinds == ["chunked_attention"] * 3 + ["full_attention"]
    assert [c["options"].get("attention_chunk") for c in calls] == [CHUNK] * 3 + [None]
    for call in calls:
        assert call["options"]["causal"] is True
        assert call["layer_options"].startswith("added")
        agree(tmp_path, call)
    manifest = yaml.safe_load((tmp_path / "manifest.yaml").read_text())
    assert "chunked layer" in manifest["cases"][0]["description"]


def test_gemma3s_sliding_layers_are_a_window(tmp_path: Path) -> None:
    calls = captured("gemma3", tmp_path)
    assert [c["layer_kind"] for c in calls] == ["sliding_attention"] * 2 + ["full_attention"]
    # Hugging Face's sliding_window W counts the query: W − 1 keys before it
    assert [c["options"].get("window") for c in calls] == [[WINDOW - 1, 0]] * 2 + [None]
    for call in calls:
        agree(tmp_path, call)


def test_a_padded_batch_keeps_its_mask_and_says_why(tmp_path: Path) -> None:
    calls = captured("llama4", tmp_path, padded=True)
    assert all("attention_chunk" not in c["options"] for c in calls)
    assert calls[0]["layer_kind"] == "chunked_attention"
    assert calls[0]["layer_options"].startswith("not added: the mask hides other keys")
