"""Tests of what a capture writes: safetensors files of torch tensors (read back by the
safetensors package, the format's own reader, and by sdpa's), sizes, file names."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from sdpa_cli.capture.writer import (
    file_stem,
    parse_size,
    safetensors_header,
    tensors_size,
    unwritable,
    write_safetensors,
)
from sdpa_cli.errors import SpecError
from sdpa_cli.files.loaders import load_array
from sdpa_cli.text import si

torch = pytest.importorskip("torch")


def test_a_call_file_reads_back_bit_for_bit_with_both_readers(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g).to(torch.bfloat16)
    tensors = {
        "q": q,
        "k": torch.randn(2, 2, 7, 8, generator=g).to(torch.float16).transpose(-1, -2),
        "mask": torch.rand(5, 7, generator=g).gt(0.3).expand(2, 1, 5, 7),
        "output": torch.randn(3, generator=g, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "c.safetensors"
    size = write_safetensors(path, tensors, {"name": "layer"}, torch)
    assert size == path.stat().st_size
    assert size == 8 + len(safetensors_header(tensors, {"name": "layer"})) + tensors_size(tensors)
    back = safetensors_torch.load_file(str(path))
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name], tensor.contiguous()), name
    ours = load_array(f"{path}:q", name="q")
    assert ours.dtype == ml_dtypes.bfloat16  # bfloat16 stays bfloat16: check needs no --dtype
    assert np.array_equal(ours.astype(np.float32), q.float().numpy())
    mask = load_array(f"{path}:mask", name="mask")
    assert mask.dtype == np.bool_
    assert np.array_equal(mask, tensors["mask"].numpy())


def test_the_header_is_padded_to_eight_bytes() -> None:
    for n in range(1, 9):
        header = safetensors_header({"x" * n: torch.zeros(n)}, {})
        assert len(header) % 8 == 0


def test_a_dtype_sdpa_does_not_read_is_named() -> None:
    assert unwritable({"q": torch.zeros(2)}) is None
    assert unwritable({"q": torch.zeros(2, dtype=torch.complex64)}) == (
        "its q is complex64, which sdpa does not read"
    )
    assert unwritable({"k": torch.zeros(2, device="meta")}) == (
        "its k is on the meta device (no data)"
    )


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1000", 1000),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 << 30),
        ("1.5G", 3 << 29),
        ("64 kB", 64_000),
        ("3k", 3072),
        ("1e3", 1000),
    ],
)
def test_sizes_parse(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "5 furlongs", "-3MB", "0"])
def test_a_bad_size_is_named(text: str) -> None:
    with pytest.raises(SpecError, match=r"^--max-bytes: "):
        parse_size(text)


def test_human_bytes_and_file_names() -> None:
    assert si(999, "B") == "999 B"
    assert si(61_056, "B") == "61.1 kB"
    assert si(2 << 30, "B") == "2.15 GB"
    assert file_stem(12, "model.layers.3.self_attn#2") == "00012-model.layers.3.self_attn_2"
    assert ":" not in file_stem(1, "a:b/c d")
