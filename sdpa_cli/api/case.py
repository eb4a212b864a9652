"""A case: one attention computation as its user names it, and what to judge in it.

The command line builds one from its arguments and flags, a manifest one from each of
its entries, a test from keywords; every runner of :mod:`sdpa_cli.api` takes the same
record, so what one of them can ask for (partials, a decode run, an option) the others
can too. A case holds what was typed: paths, and options as text or values; it is read
(:meth:`Case.load`) where it runs, a worker process or a Dask worker included.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sdpa_cli.api.outputs import Outputs
from sdpa_cli.engine.fp8 import descale_number
from sdpa_cli.names import DESCALES, EXPORTS
from sdpa_cli.text import printable

if TYPE_CHECKING:
    from sdpa_cli.engine.driver import Progress
    from sdpa_cli.engine.spec import AttentionSpec

Watch = Callable[["AttentionSpec", str], AbstractContextManager["Progress | None"]]
"""How a run reports its progress: given the computation and a word for what it does
(``checking``), a context that yields the engine's progress callback (or None). The
command line draws a bar; the API's default draws nothing."""


@contextlib.contextmanager
def unwatched(spec: AttentionSpec, what: str) -> Iterator[Progress | None]:
    """No progress reported: the default :data:`Watch`."""
    yield None


def names_a_file(key: str, value: str) -> bool:
    """Whether an input's value names a file: all do but a descale given as a number
    (``--q-descale 0.02``, ``q-descale: 0.02`` or ``"0.02"`` in a manifest)."""
    return key not in DESCALES or descale_number(value) is None


@dataclass(frozen=True)
class Case:
    """One case: the files it reads, its options as typed, and the exports to judge.

    Attributes:
        inputs: Q K V, three files, or one case file holding them and options.
        tensors: the other inputs' files (``bias``, ``mask``, and those of
            :data:`~sdpa_cli.names.TENSOR_FLAGS`), over a case file's.
        options: the options of the computation as typed (name → value; the names of
            :data:`~sdpa_cli.engine.options.OPTION_NAMES`), over a case file's.
        where: where each option was given, for messages (a manifest's entry); a
            flag by default, ``--causal-align``.
        expect: what a kernel exported (:data:`~sdpa_cli.names.EXPORTS`) → its file.
        partials: a split-KV kernel's partial outputs and LSEs (a YAML/JSON list).
        dout: the gradient of the output a backward kernel was given (its file), with
            gradient exports (``dq``, ``dk``, ``dv``).
        decode: whether to compare the prefill with its tokens decoded one by one.
        check: this case's settings of ``sdpa check`` (parsed; a manifest's), under
            the command line's.
        name: the case's name in a report (a manifest's); empty: its title.
        root: the folder every file the case names must stay in (a manifest's, unless
            ``--allow-outside``); None: a case given directly, read as given.
    """

    inputs: tuple[str, ...] = ()
    tensors: Mapping[str, str] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)
    where: Mapping[str, str] = field(default_factory=dict)
    expect: Mapping[str, str] = field(default_factory=dict)
    partials: str | None = None
    dout: str | None = None
    decode: bool = False
    check: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    root: str | None = None

    def __post_init__(self) -> None:
        for export in self.expect:
            if export not in EXPORTS:
                raise ValueError(f"unknown export {export!r}; expected one of {EXPORTS}")

    def files(self) -> list[str]:
        """Every file the case reads, for the check that no output destroys one."""
        tensors = [p for k, p in self.tensors.items() if names_a_file(k, p)]
        return [*self.inputs, *tensors, *self.expect.values()] + [
            f for f in (self.partials, self.dout) if f
        ]

    def given(self, flags: Mapping[str, Any]) -> Case:
        """This case with options given beside it (the command line's, over a
        manifest's): each named by its flag in messages, as typed."""
        flags = {k: v for k, v in flags.items() if v is not None}
        if not flags:
            return self
        where = {k: w for k, w in self.where.items() if k not in flags}
        return dataclasses.replace(self, options={**self.options, **flags}, where=where)

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Within it, the case's files are read as its source allows: a manifest's
        confined to its folder, their content kept out of messages."""
        if self.root is None:
            yield
            return
        # imported here: the command line builds cases without loading the readers
        from sdpa_cli.files.confine import rooted
        from sdpa_cli.text import unechoed

        with unechoed(), rooted(self.root):
            yield

    def load(
        self, outputs: Outputs | None = None, also: Sequence[str | None] = ()
    ) -> tuple[AttentionSpec, str | None]:
        """The validated computation, and the case file's description (if any);
        ``outputs`` (the files the run will write) refused first when one would destroy
        a file the case reads, or one of ``also`` (the run's other inputs: ``--dout``).

        Raises:
            SdpaError: a file that cannot be read, an option or shape that is wrong,
                naming it; an output that is one of the inputs.
        """
        # imported here: the command line builds cases without loading numpy
        from sdpa_cli.engine.inputs import load_spec

        if outputs is not None:
            outputs.check([*self.files(), *also])
        with self.reading():
            return load_spec(self.inputs, self.tensors, self.options, self.where)

    def title(self, description: str | None) -> str:
        """How a report heads the case: its name, the case file's description, or
        the inputs as given."""
        if self.name:
            return self.name
        # one line: it heads a table and the error lines on stderr
        return printable((description or "").strip()) or printable(" ".join(self.inputs))
