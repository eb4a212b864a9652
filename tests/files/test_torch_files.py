"""PyTorch files (what ``torch.save`` writes) as inputs: recognised by their content,
read only through ``torch.load(weights_only=True)``, every failure one line.

torch's own writer makes the files; the values read back are torch's own. Without
torch the tests that need it skip, and one test hides torch to check the line that
says how to read such a file.
"""

from __future__ import annotations

import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from clirunner import assert_one_error_line, invoke, strict_json

from sdpa_cli.errors import InputError
from sdpa_cli.files import limits
from sdpa_cli.files.loaders import load_array, sniff

torch = pytest.importorskip("torch")

MARKER = "pwned-by-torch-pickle"
"""What a hostile pickle would create in the working directory if it were ever run."""


class Hostile:
    """Unpickling this calls os.mkdir(MARKER)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (MARKER,))


def qkv(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(1, 2, 4, 8, generator=g) for n in "qkv"}


def load_error(path: str) -> InputError:
    with pytest.raises(InputError) as info:
        load_array(path)
    return info.value


# --- recognised by content ---------------------------------------------------------------


def test_zip_and_legacy_files_are_sniffed_whatever_their_name(tmp_path: Path) -> None:
    t = torch.arange(6.0).reshape(2, 3)
    torch.save(t, tmp_path / "a.weights")
    torch.save(t, tmp_path / "b.npz", _use_new_zipfile_serialization=False)
    assert sniff(tmp_path / "a.weights", "a") == "torch"
    assert sniff(tmp_path / "b.npz", "b") == "torch"
    for name in ("a.weights", "b.npz"):
        arr = load_array(str(tmp_path / name))
        np.testing.assert_array_equal(arr, t.numpy())


def test_the_zip_format_is_memory_mapped_not_copied(tmp_path: Path) -> None:
    torch.save(torch.ones(1000, 8), tmp_path / "big.pt")
    arr = load_array(str(tmp_path / "big.pt"))
    assert arr.shape == (1000, 8)
    # torch maps the storage: the array is a view of it, not an owned copy.
    assert not arr.flags.owndata


def test_a_dict_of_tensors_picks_a_member_by_name(tmp_path: Path) -> None:
    tensors = qkv()
    torch.save(tensors, tmp_path / "qkv.pt")
    np.testing.assert_array_equal(load_array(str(tmp_path / "qkv.pt:k")), tensors["k"].numpy())
    err = load_error(str(tmp_path / "qkv.pt"))
    assert (
        err.problem == f"holds 3 tensors; pick one with {tmp_path / 'qkv.pt'}:NAME (names: q, k, v)"
    )
    err = load_error(str(tmp_path / "qkv.pt:z"))
    assert err.problem == "has no tensor 'z' (names: q, k, v)"


def test_a_checkpoint_names_nested_tensors_by_path_and_skips_the_rest(tmp_path: Path) -> None:
    w = torch.randn(3, 3)
    torch.save({"model": {"attn.q": w}, "epoch": 3, "extra": [torch.ones(2)]}, tmp_path / "c.pt")
    np.testing.assert_array_equal(load_array(str(tmp_path / "c.pt:model.attn.q")), w.numpy())
    np.testing.assert_array_equal(load_array(str(tmp_path / "c.pt:extra.0")), np.ones(2))
    assert "names: model.attn.q, extra.0" in load_error(str(tmp_path / "c.pt:epoch")).problem


def test_bfloat16_and_float8_tensors_become_ml_dtypes_arrays(tmp_path: Path) -> None:
    t = torch.tensor([1.5, -2.25, 3.0e38])
    torch.save({"bf": t.to(torch.bfloat16), "f8": t[:2].to(torch.float8_e4m3fn)}, tmp_path / "n.pt")
    bf = load_array(str(tmp_path / "n.pt:bf"))
    f8 = load_array(str(tmp_path / "n.pt:f8"))
    assert bf.dtype == ml_dtypes.bfloat16
    assert f8.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(bf.astype(np.float32), t.to(torch.bfloat16).float().numpy())
    np.testing.assert_array_equal(f8.astype(np.float32), [1.5, -2.25])


def test_a_sparse_or_complex_tensor_is_refused_naming_the_member(tmp_path: Path) -> None:
    torch.save(
        {"s": torch.eye(2).to_sparse(), "c": torch.ones(2, dtype=torch.complex64)},
        tmp_path / "x.pt",
    )
    assert "is a sparse_coo tensor" in load_error(str(tmp_path / "x.pt:s")).problem
    assert load_error(str(tmp_path / "x.pt:c")).problem.startswith("has complex dtype complex64")


# --- never unpickled ---------------------------------------------------------------------


def test_a_pickle_weights_only_refuses_is_one_line_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    torch.save({"q": torch.ones(2, 2), "evil": Hostile()}, "evil.pt")
    result = invoke("compute", "evil.pt:q", "evil.pt:q", "evil.pt:q")
    line = assert_one_error_line(result)
    assert line.startswith("sdpa: error: evil.pt:q: torch.load(weights_only=True) refuses it (")
    assert "GLOBAL posix.mkdir" in line or "GLOBAL os.mkdir" in line
    assert not (tmp_path / MARKER).exists()


def test_a_plain_pickle_is_refused_before_torch_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    Path("x.pt").write_bytes(pickle.dumps(Hostile(), protocol=4))
    line = assert_one_error_line(invoke("inspect", "x.pt"))
    assert line == (
        "sdpa: error: x.pt: is a Python pickle, not a tensor file (nor torch.save's); "
        "sdpa never unpickles: save the arrays with numpy.save"
    )
    assert not (tmp_path / MARKER).exists()


def test_a_corrupt_archive_is_one_line(tmp_path: Path) -> None:
    torch.save(torch.ones(4), tmp_path / "t.pt")
    with zipfile.ZipFile(tmp_path / "t.pt") as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    with zipfile.ZipFile(tmp_path / "broken.pt", "w") as zf:  # data.pkl kept, storage gone
        for name, data in members.items():
            if "/data/" not in name:
                zf.writestr(name, data)
    line = assert_one_error_line(invoke("inspect", str(tmp_path / "broken.pt")))
    assert line.startswith(f"sdpa: error: {tmp_path / 'broken.pt'}: cannot be read by torch.load (")


def test_a_pt_name_on_other_bytes_says_what_it_is_not(tmp_path: Path) -> None:
    (tmp_path / "x.pt").write_bytes(b"hello world, not a tensor")
    assert load_error(str(tmp_path / "x.pt")).problem == (
        "is not a PyTorch file (neither torch.save's zip archive nor its pickle)"
    )


def test_a_legacy_file_larger_than_memory_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(torch.ones(64), tmp_path / "l.pt", _use_new_zipfile_serialization=False)
    monkeypatch.setattr(limits, "available_memory", lambda: 100)
    problem = load_error(str(tmp_path / "l.pt")).problem
    assert problem.startswith("needs 0.0 GiB of memory to be read, but 0.0 GiB is available")


def test_without_torch_one_line_says_how_to_read_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(torch.ones(2, 2), tmp_path / "x.pt")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    line = assert_one_error_line(invoke("inspect", str(tmp_path / "x.pt")))
    assert line == (
        f"sdpa: error: {tmp_path / 'x.pt'}: a PyTorch file; install torch to read it "
        "(pip install torch) or save it with numpy.save"
    )


# --- every command reads them ---------------------------------------------------------------


def test_inspect_lists_every_tensor_and_the_refused_ones(tmp_path: Path) -> None:
    tensors = {**qkv(), "c": torch.ones(2, dtype=torch.complex64)}
    torch.save(tensors, tmp_path / "m.pt")
    result = invoke("inspect", str(tmp_path / "m.pt"), "--format", "json")
    assert result.exit_code == 2
    files = strict_json(result.stdout)["files"]
    names = [t["name"] for t in files[0]["tensors"]]
    assert names == ["q", "k", "v", "c"]
    assert files[0]["format"] == "torch"
    assert result.stderr.startswith(f"sdpa: error: {tmp_path / 'm.pt'}:c: has complex dtype")


def test_compute_and_check_read_pt_members_as_torch_computed_them(tmp_path: Path) -> None:
    tensors = qkv(3)
    out = torch.nn.functional.scaled_dot_product_attention(*tensors.values(), is_causal=True)
    torch.save({**tensors, "out": out}, tmp_path / "run.pt")
    files = [f"{tmp_path / 'run.pt'}:{n}" for n in "qkv"]
    result = invoke("compute", *files, "--causal", "--format", "json", "--stages", "output")
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(strict_json(result.stdout)["output"], out.numpy(), atol=1e-6)
    checked = invoke("check", *files, "--causal", "--expect-output", f"{tmp_path / 'run.pt'}:out")
    assert checked.exit_code == 0, checked.output


def test_a_legacy_file_of_a_later_pickle_protocol_is_recognised(tmp_path: Path) -> None:
    """Protocol 4 frames the magic number; torch's weights_only reader has no FRAME
    opcode: one line saying so, not "a Python pickle"."""
    torch.save(
        torch.ones(3), tmp_path / "l4.pt", _use_new_zipfile_serialization=False, pickle_protocol=4
    )
    assert sniff(tmp_path / "l4.pt", "l4") == "torch"
    problem = load_error(str(tmp_path / "l4.pt")).problem
    assert problem.startswith("torch.load(weights_only=True) ")
    assert "re-save it" in problem or problem.startswith("torch.load(weights_only=True) refuses")
