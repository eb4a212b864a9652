"""The files a run writes: one table of their kinds (:data:`OUTPUT_FILES`), one record
of those a run was asked for (:class:`Outputs`), one function that writes them
(:func:`write_outputs`).

A command adds the options of the kinds it writes (``cli/options.py`` reads their flags
and file names here); the run checks them against its inputs before anything is
computed; at the end each kind asked for gets its writer (a report's bytes from
:mod:`sdpa_cli.report`, an .npz from :mod:`sdpa_cli.stream_save`, a picture of the
tables from the command line) and :func:`write_outputs` writes them all or none,
renamed into place once stdout is delivered (:func:`~sdpa_cli.files.writers.staged`).
A new format is an entry here and its writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sdpa_cli.files.writers import Writer


@dataclass(frozen=True)
class OutputFile:
    """One kind of file a run may write: its flag, the file name shown in help, and
    what it holds (``{what}``: what the command shows, for the pictures)."""

    flag: str
    metavar: str
    help: str


OUTPUT_FILES = {
    "junit": OutputFile("--junit", "FILE.xml", "Also write a JUnit XML report, atomically."),
    "report": OutputFile("--report", "FILE.json", "Also write the JSON report, atomically."),
    "save": OutputFile("--save", "FILE.npz", "Write {what} to FILE.npz, atomically."),
    "svg": OutputFile("--export-svg", "FILE.svg", "Also write {what} as an SVG picture."),
    "html": OutputFile("--export-html", "FILE.html", "Also write {what} as an HTML page."),
    "page": OutputFile(
        "--html",
        "FILE.html",
        "Also write {what} as one self-contained HTML page: heat maps, every value on "
        "hover, nothing fetched (opens offline).",
    ),
    "plot": OutputFile(
        "--plot",
        "FILE.png",
        "Also write heatmaps of {what} (needs matplotlib: pip install matplotlib).",
    ),
}
"""Every kind of file a command writes, by the name its option passes it as, in the
order a run checks and writes them."""

PICTURES = ("svg", "html")
"""The kinds that picture what a command shows: its tables, recorded in color."""

REPORTS = ("junit", "report")
"""The documents a check's run writes (:meth:`~sdpa_cli.api.check.CheckRun.writers`),
which ``sdpa check`` and ``sdpa report merge`` offer: a new format is its entry in
:data:`OUTPUT_FILES`, here, and its writer there."""


@dataclass(frozen=True)
class Outputs:
    """The files a run was asked to write: kind (of :data:`OUTPUT_FILES`) → path."""

    paths: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def given(cls, **paths: str | None) -> Outputs:
        """The kinds given a path (None: not asked for)."""
        for kind in paths:
            if kind not in OUTPUT_FILES:
                raise ValueError(
                    f"no output file {kind!r}; the kinds are {', '.join(OUTPUT_FILES)}"
                )
        return cls({k: p for k, p in paths.items() if p is not None})

    def __contains__(self, kind: object) -> bool:
        return kind in self.paths

    def wants(self, *kinds: str) -> bool:
        """Whether any of ``kinds`` was asked for."""
        return any(k in self.paths for k in kinds)

    def flagged(self) -> list[tuple[str, str]]:
        """``(flag, path)`` of each file, in :data:`OUTPUT_FILES` order, as messages
        name them."""
        return [(OUTPUT_FILES[k].flag, self.paths[k]) for k in OUTPUT_FILES if k in self.paths]

    def check(self, inputs: Iterable[str | None]) -> None:
        """Refuse, before anything runs, a file that is one of ``inputs`` or another
        output, or that cannot be written (a directory).

        Raises:
            InputError: naming the option and the file.
        """
        # imported here: the command line builds this record for its help, fast
        from sdpa_cli.files.outputs import check_outputs

        check_outputs([("input", p) for p in inputs], self.flagged())


def text_file(text: str) -> Writer:
    """The writer of a file holding ``text``, in UTF-8 (a page)."""
    data = text.encode("utf-8")
    return lambda f: f.write(data)


def write_outputs(outputs: Outputs, writers: Mapping[str, Writer]) -> None:
    """Every file of ``outputs``, each by its kind's writer, atomically, all or none.

    Raises:
        InputError: naming the file that cannot be written.
        KeyError: a kind asked for that the run has no writer for (a bug).
    """
    # imported here: the command line builds the record for its help, fast
    from sdpa_cli.files.writers import write_all_atomic

    write_all_atomic([(outputs.paths[k], writers[k]) for k in OUTPUT_FILES if k in outputs])
