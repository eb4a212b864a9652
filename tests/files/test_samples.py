"""files/samples.py: the shipped samples found, described, named as sample:NAME, copied."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sdpa_cli.errors import InputError
from sdpa_cli.files import samples
from sdpa_cli.files.samples import catalog, copy_samples, expand, resolve, sample_files

REPO_SAMPLES = Path(__file__).resolve().parents[2] / "samples"


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    """A samples folder of every kind of entry, with descriptions known in advance."""
    root = tmp_path / "samples"
    (root / "sub").mkdir(parents=True)
    (root / "tool").mkdir()
    (root / "a.yaml").write_text(
        "# A comment that the description wins over.\n"
        "description: >-\n  First sentence, d_k = 2. Second sentence.\nq: [1]\n",
        encoding="utf-8",
    )
    (root / "b.yaml").write_text(
        "# Only a comment here,\n# on two lines. And more.\nq: [1]\n", encoding="utf-8"
    )
    (root / "b.json").write_text('{"q": [1]}', encoding="utf-8")
    (root / "ids.json").write_text("[0, 0, 1]", encoding="utf-8")
    for part, shape in (("q", (1, 2, 3, 4)), ("k", (1, 2, 5, 4)), ("v", (1, 2, 5, 6))):
        np.save(root / f"x_{part}.npy", np.zeros(shape, np.float16))
    np.save(root / "lone_q.npy", np.zeros((2, 3)))
    np.savez(root / "c.npz", q=np.zeros((3, 4)), k=np.zeros((5, 4)))
    (root / "sub" / "m.yaml").write_text(
        "# The folder's manifest, as a capture writes it:\n# python gen.py\ncases: []\n",
        encoding="utf-8",
    )
    (root / "sub" / "t.npy").write_bytes(b"")
    (root / "tool" / "run.py").write_text('"""Run a tool\non two lines.\n\nMore."""\n')
    (root / "tool" / "__pycache__").mkdir()
    (root / "tool" / "__pycache__" / "run.cpython-311.pyc").write_bytes(b"")
    return root


def test_catalog_names_and_describes_every_kind_of_entry(fake: Path) -> None:
    got = [(s.name, s.files, s.description) for s in catalog(fake)]
    assert got == [
        ("a", ("a.yaml",), "First sentence, d_k = 2."),
        ("b.json", ("b.json",), "a case file: q"),
        ("b.yaml", ("b.yaml",), "Only a comment here, on two lines."),
        (
            "x_{q,k,v}.npy",
            ("x_q.npy", "x_k.npy", "x_v.npy"),
            "float16 tensors: q (1, 2, 3, 4), k (1, 2, 5, 4), v (1, 2, 5, 6)",
        ),
        ("c.npz", ("c.npz",), "arrays: q (3, 4), k (5, 4)"),
        ("ids.json", ("ids.json",), "values [0, 0, 1]"),
        ("lone_q.npy", ("lone_q.npy",), "npy"),
        ("sub/", ("sub/m.yaml", "sub/t.npy"), "The folder's manifest, as a capture writes it"),
        ("tool/", ("tool/run.py",), "Run a tool on two lines."),
    ]


def test_catalog_of_the_repository_holds_each_file_once() -> None:
    entries = catalog(REPO_SAMPLES)
    listed = [f for s in entries for f in s.files]
    assert sorted(listed) == sample_files(REPO_SAMPLES)
    assert len(listed) == len(set(listed))
    by_name = {s.name: s for s in entries}
    assert by_name["scorecard"].files == ("scorecard.yaml",)
    assert by_name["batched_{q,k,v}.npy"].description == (
        "float64 tensors: q (2, 4, 6, 8), k (2, 2, 6, 8), v (2, 2, 6, 4)"
    )
    assert by_name["segments.json"].description == "values [0, 0, 1]"
    assert len(by_name["check/"].files) == 14
    assert all(s.description for s in entries)


def test_the_checkout_reads_the_repository_samples() -> None:
    assert samples.samples_dir() == REPO_SAMPLES


def test_resolve_a_case_file_by_its_name_yaml_before_json(fake: Path) -> None:
    assert resolve("sample:a", fake) == str(fake / "a.yaml")
    assert resolve("sample:b", fake) == str(fake / "b.yaml")
    assert resolve("sample:b.json", fake) == str(fake / "b.json")


def test_resolve_exact_names_paths_in_folders_and_members(fake: Path) -> None:
    assert resolve("sample:x_q.npy", fake) == str(fake / "x_q.npy")
    assert resolve("sample:sub/t.npy", fake) == str(fake / "sub" / "t.npy")
    assert resolve("sample:c.npz:q", fake) == str(fake / "c.npz") + ":q"


def test_resolve_an_unknown_name_lists_the_known_ones(fake: Path) -> None:
    with pytest.raises(InputError) as info:
        resolve("sample:nope", fake)
    assert str(info.value) == (
        "sample:nope: no such sample; known: a, b.json, b.yaml, x_{q,k,v}.npy, c.npz, ids.json, "
        "lone_q.npy, sub/, tool/ (a path inside a folder too, e.g. check/q.npy)"
    )
    with pytest.raises(InputError, match=r"^sample:sub: no such sample"):
        resolve("sample:sub", fake)  # a folder is no file


def test_expand_leaves_other_names_alone() -> None:
    for text in ("q.npy", "samples/scorecard.yaml", "file:///tmp/q.npy", "x.npz:sample"):
        assert expand(text) == text
    assert expand("sample:scorecard") == str(REPO_SAMPLES / "scorecard.yaml")


def test_copy_writes_every_file_byte_for_byte(tmp_path: Path) -> None:
    target, written = copy_samples(tmp_path / "new" / "dir")
    assert target == tmp_path / "new" / "dir" / "samples"
    assert sorted(p.relative_to(target).as_posix() for p in written) == sample_files()
    for f in ("scorecard.yaml", "check/partials/out_0_8.npy", "model/manifest.yaml"):
        assert (target / f).read_bytes() == (REPO_SAMPLES / f).read_bytes()


def test_copy_interrupted_the_moment_a_temporary_appears_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def made_then_interrupted(path: Path) -> int:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        raise KeyboardInterrupt

    monkeypatch.setattr(samples, "create_new", made_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        copy_samples(tmp_path / "out")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_copy_refuses_to_overwrite_and_writes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "samples"
    target.mkdir()
    (target / "scorecard.yaml").write_text("mine", encoding="utf-8")
    with pytest.raises(InputError) as info:
        copy_samples(tmp_path)
    assert str(info.value) == (
        f"{target}: already holds scorecard.yaml; --force overwrites the samples' files"
    )
    assert [p.name for p in target.iterdir()] == ["scorecard.yaml"]
    assert (target / "scorecard.yaml").read_text(encoding="utf-8") == "mine"
    copy_samples(tmp_path, force=True)
    assert (target / "scorecard.yaml").read_bytes() == (
        REPO_SAMPLES / "scorecard.yaml"
    ).read_bytes()


def test_copy_over_a_full_copy_names_three_and_counts_the_rest(tmp_path: Path) -> None:
    copy_samples(tmp_path)
    n = len(sample_files())
    with pytest.raises(InputError, match=rf"already holds [^,]+, [^,]+, [^ ]+ and {n - 3} more;"):
        copy_samples(tmp_path)


def test_copy_into_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x", encoding="utf-8")
    with pytest.raises(InputError, match=r"f: is a file, not a folder to copy the samples into$"):
        copy_samples(tmp_path / "f")


def test_no_samples_anywhere_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(samples, "__file__", "/nonexistent/sdpa_cli/files/samples.py")
    monkeypatch.setattr(samples, "files", lambda _: Path("/nonexistent/sdpa_cli"))
    with pytest.raises(InputError, match=r"^samples: not found: this copy of sdpa was installed"):
        samples.samples_dir()


def outside(tmp_path: Path) -> tuple[Path, Path]:
    """A file and a folder outside the copy's folder, that links inside it point to."""
    victim = tmp_path / "victim.txt"
    victim.write_text("VICTIM", encoding="utf-8")
    victim_dir = tmp_path / "victimdir"
    victim_dir.mkdir()
    (victim_dir / "q.npy").write_text("V2", encoding="utf-8")
    return victim, victim_dir


@pytest.mark.parametrize("linked", ["samples", "samples/check", "samples/check/partials"])
def test_copy_refuses_a_linked_folder_it_would_write_into(tmp_path: Path, linked: str) -> None:
    victim, victim_dir = outside(tmp_path)
    dest = tmp_path / "dest"
    (dest / linked).parent.mkdir(parents=True)
    (dest / linked).symlink_to(victim_dir)
    with pytest.raises(InputError) as info:
        copy_samples(dest, force=True)
    assert str(info.value) == (
        f"{dest / linked}: is a symbolic link; the samples are copied only into real folders"
    )
    assert sorted(p.name for p in victim_dir.iterdir()) == ["q.npy"]
    assert (victim_dir / "q.npy").read_text(encoding="utf-8") == "V2"
    assert victim.read_text(encoding="utf-8") == "VICTIM"


def test_copy_with_force_replaces_a_linked_file_never_writing_through(tmp_path: Path) -> None:
    victim, _ = outside(tmp_path)
    target = tmp_path / "dest" / "samples"
    target.mkdir(parents=True)
    (target / "causal.yaml").symlink_to(victim)
    (target / "cross.yaml").symlink_to(tmp_path / "dangling.yaml")
    hard = tmp_path / "hard.txt"
    hard.write_text("HARD", encoding="utf-8")
    os.link(hard, target / "scorecard.yaml")
    with pytest.raises(
        InputError, match=r"already holds causal\.yaml, cross\.yaml, scorecard\.yaml;"
    ):
        copy_samples(tmp_path / "dest")
    copy_samples(tmp_path / "dest", force=True)
    for f in ("causal.yaml", "cross.yaml", "scorecard.yaml"):
        assert not (target / f).is_symlink()
        assert (target / f).read_bytes() == (REPO_SAMPLES / f).read_bytes()
    assert victim.read_text(encoding="utf-8") == "VICTIM"
    assert hard.read_text(encoding="utf-8") == "HARD"
    assert not (tmp_path / "dangling.yaml").exists()
    assert not [p for p in target.rglob("*.tmp")]


@pytest.mark.parametrize(
    ("typed", "hint"),
    [
        (
            "samples/scorecard.yaml",
            "the samples ship with sdpa: sdpa samples --copy . puts them here, or name it "
            "sample:scorecard",
        ),
        ("scorecard.yaml", "a sample ships with sdpa under that name: sample:scorecard"),
        ("cross.npz:q", "a sample ships with sdpa under that name: sample:cross.npz:q"),
    ],
)
def test_a_missing_file_a_sample_is_named_after_is_named_as_that_sample(
    workdir: Path, typed: str, hint: str
) -> None:
    """A newcomer types a sample's file name in an empty folder (the README's
    ``samples/...``, or without its folder): the one line says how to name it."""
    from clirunner import assert_one_error_line, invoke

    line = assert_one_error_line(invoke("inspect", typed))
    assert line == f"sdpa: error: {typed}: no such file ({hint})"


def test_a_missing_file_no_sample_is_named_after_gets_no_hint(workdir: Path) -> None:
    from clirunner import assert_one_error_line, invoke

    line = assert_one_error_line(invoke("inspect", "mine.yaml"))
    assert line == "sdpa: error: mine.yaml: no such file"
