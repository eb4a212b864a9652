"""Options shared by several commands, each group given to the command as one record
(sqlite-utils' ``@output_options``): the case (:func:`case_options`, a
:class:`~sdpa_cli.api.case.Case`), the files written (:func:`output_files`, an
:class:`~sdpa_cli.api.outputs.Outputs`), what a table shows (:func:`view_options`, a
:class:`ViewFlags`), the findings' thresholds (:func:`diagnostic_options`). Values
stay as typed; the API resolves them.

Only the standard library, click and :mod:`sdpa_cli.names` are imported here, so that
``sdpa COMMAND --help`` stays fast.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import click

from sdpa_cli.api.outputs import OUTPUT_FILES, Outputs
from sdpa_cli.api.picks import check_slice, parse_rows, parse_stages
from sdpa_cli.cli.attention import ATTENTION_OPTIONS
from sdpa_cli.cli.completion import files, stage_names, word_list
from sdpa_cli.names import BACKENDS, EXPORTS, STAGES

if TYPE_CHECKING:
    from sdpa_cli.api.case import Case
    from sdpa_cli.engine.spec import AttentionSpec
    from sdpa_cli.render.common import View

F = TypeVar("F", bound=Callable[..., Any])
Option = Callable[[Any], Any]
"""A click decorator (an option or an argument), as the groups below hold them."""


def grouped(param: str, make: Callable[..., Any], options: Sequence[Option]) -> Callable[[F], F]:
    """The click ``options`` given to the command as one keyword, ``param``:
    ``make(**their values)``, a record, instead of one parameter each."""

    def probe() -> None: ...

    for option in options:
        option(probe)
    names = [p.name for p in getattr(probe, "__click_params__", []) if p.name]

    def decorate(f: F) -> F:
        @functools.wraps(f)
        def command(*args: Any, **kwargs: Any) -> Any:
            kwargs[param] = make(**{name: kwargs.pop(name) for name in names})
            return f(*args, **kwargs)

        wrapped: Any = command
        for option in reversed(options):
            wrapped = option(wrapped)
        return wrapped  # type: ignore[no-any-return]

    return decorate


# --- single options ---------------------------------------------------------------------


class PositiveFinite(click.FloatRange):
    """A positive finite number: click's range lets NaN through (every comparison with
    it is false) and inf past an open bound."""

    name = "positive number"

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a positive finite number.", param, ctx)
        return number


COLOR_OPTION = click.option(
    "--color/--no-color",
    default=None,
    help="Force color on or off (default: on for a terminal, off with NO_COLOR).",
)
JOBS_HELP = "Threads computing blocks (default: the number of cores)."
BACKEND_OPTION = click.option(
    "--backend",
    type=click.Choice(("auto", *BACKENDS)),
    help="The library that computes the blocks: numpy, or torch on --device (default: "
    "numpy, torch for a --device other than cpu; config: backend).",
)
DEVICE_OPTION = click.option(
    "--device",
    metavar="DEVICE",
    help="Where torch computes: cpu, cuda, cuda:N (default cpu; config: device).",
)


class Computing(NamedTuple):
    """``--jobs``, ``--backend`` and ``--device`` as given (None: not given)."""

    jobs: int | None = None
    backend: str | None = None
    device: str | None = None


def computing_options(jobs_help: str = JOBS_HELP) -> Callable[[F], F]:
    """``--jobs``, ``--backend`` and ``--device``: what computes a command's blocks,
    given to the command as one keyword, ``computing``."""
    jobs = click.option("--jobs", type=click.IntRange(min=1), metavar="N", help=jobs_help)
    return grouped("computing", Computing, (jobs, BACKEND_OPTION, DEVICE_OPTION))


def format_option(help: str, choices: tuple[str, ...] = ("table", "json")) -> Callable[[F], F]:
    """``--format``: what stdout gets, a table by default."""
    return click.option(
        "--format",
        "fmt",
        type=click.Choice(choices),
        default="table",
        show_default=True,
        help=help,
    )


FORMAT_OPTION: Option = format_option(
    "Tables for a person, or one JSON/YAML object on stdout.", ("table", "json", "yaml")
)


# --- the case ---------------------------------------------------------------------------

EXPECT_OPTIONS: list[Option] = [
    click.option(
        "--expect-output",
        metavar="FILE",
        shell_complete=files,
        help="The exported output, (..., L, Ev).",
    ),
    click.option(
        "--expect-weights",
        metavar="FILE",
        shell_complete=files,
        help="The exported attention weights, (..., L, S).",
    ),
    click.option(
        "--expect-lse",
        metavar="FILE",
        shell_complete=files,
        help="The exported logsumexp per row, (..., L), as FlashAttention returns it.",
    ),
    click.option(
        "--dout",
        metavar="FILE",
        shell_complete=files,
        help="The gradient of the output a backward kernel was given, (..., L, Ev): with "
        "--expect-dq, --expect-dk, --expect-dv, --expect-dbias, --expect-dsinks.",
    ),
    click.option(
        "--expect-dq",
        metavar="FILE",
        shell_complete=files,
        help="The exported gradient of Q, shaped as Q (with --dout).",
    ),
    click.option(
        "--expect-dk",
        metavar="FILE",
        shell_complete=files,
        help="The exported gradient of K, shaped as K (with --dout).",
    ),
    click.option(
        "--expect-dv",
        metavar="FILE",
        shell_complete=files,
        help="The exported gradient of V, shaped as V (with --dout).",
    ),
    click.option(
        "--expect-dbias",
        metavar="FILE",
        shell_complete=files,
        help="The exported gradient of the bias, shaped as the bias (with --dout).",
    ),
    click.option(
        "--expect-dsinks",
        metavar="FILE",
        shell_complete=files,
        help="The exported gradient of the sinks, one per head (with --dout).",
    ),
    click.option(
        "--expect-partials",
        "partials",
        metavar="FILE",
        shell_complete=files,
        help="Split-KV partials: a YAML/JSON list of {keys: START:STOP, output: FILE, lse: FILE}; "
        "each checked over its keys, their merge against the whole attention.",
    ),
    click.option(
        "--decode",
        is_flag=True,
        help="Also compare this causal prefill with the same tokens decoded one query at a "
        "time against the growing cache (query i after the S − L cached keys, or at "
        "--query-offset + i): equal to rounding in float64, within the format's tolerance "
        "under --dtype. An --expect-output beside it (a decode run's steps, stacked) is "
        "judged against the prefill. In a manifest: decode: true.",
    ),
]
"""What ``sdpa check`` judges besides the inputs."""


def _case(inputs: tuple[str, ...], **values: Any) -> Case:
    """The case the command line names: ``--NAME FILE`` options (``NAME_path``) are its
    tensors, ``--expect-NAME`` its exports, the rest its options as typed."""
    # imported here: the record alone (no numpy), when the command runs
    from sdpa_cli.api.case import Case

    partials = values.pop("partials", None)
    dout = values.pop("dout", None)
    decode = bool(values.pop("decode", False))
    expect = {n: p for n in EXPORTS if (p := values.pop(f"expect_{n}", None)) is not None}
    tensors = {k.removesuffix("_path"): v for k, v in values.items() if k.endswith("_path")}
    options = {k: v for k, v in values.items() if not k.endswith("_path") and v is not None}
    tensors = {k: v for k, v in tensors.items() if v is not None}
    return Case(
        inputs, tensors, options, expect=expect, partials=partials, dout=dout, decode=decode
    )


def case_options(*, judged: bool = False, required: bool = True) -> Callable[[F], F]:
    """``Q K V | CASE`` and every option of the computation (with ``judged``, the
    exports ``sdpa check`` judges), given to the command as ``case``."""
    inputs = click.argument(
        "inputs", nargs=-1, required=required, metavar="Q K V | CASE", shell_complete=files
    )
    options = [inputs, *(EXPECT_OPTIONS if judged else []), *ATTENTION_OPTIONS]
    return grouped("case", _case, options)


# --- the files a run writes ---------------------------------------------------------------


def output_files(*kinds: str, what: str = "", **helps: str) -> Callable[[F], F]:
    """The options of the files of ``kinds`` (:data:`~sdpa_cli.api.outputs.OUTPUT_FILES`),
    given to the command as ``outputs``; ``what`` the command shows (the pictures'
    help), ``helps`` a kind's own help."""
    options = [
        click.option(
            OUTPUT_FILES[kind].flag,
            kind,
            metavar=OUTPUT_FILES[kind].metavar,
            shell_complete=files,
            help=helps.get(kind) or OUTPUT_FILES[kind].help.format(what=what),
        )
        for kind in kinds
    ]
    return grouped("outputs", Outputs.given, options)


def sample_path(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """A file option's value with ``sample:NAME`` resolved to the shipped sample (a
    manifest, which names its files beside it), as the inputs resolve theirs."""
    if value is None:
        return None
    # imported here: keeps sdpa --help fast
    from sdpa_cli.files.samples import expand

    return expand(value)


TOKENS_OPTION = click.option(
    "--tokens",
    metavar="FILE",
    shell_complete=files,
    help="Label positions with tokens on --html pages: one token a line, or a JSON list "
    '(or {"queries": [...], "keys": [...]} for cross-attention).',
)


# --- what a table shows -------------------------------------------------------------------


@dataclass(frozen=True)
class ViewFlags:
    """What the tables show, as typed; :meth:`view` checks it against the computation."""

    stages: str | None = None
    batch: int | None = None
    head: int | None = None
    rows: str | None = None
    keys: str | None = None
    max_rows: int = 16
    max_slices: int = 1
    precision: int = 4

    def view(self, spec: AttentionSpec, width: int, available: tuple[str, ...] = ()) -> View:
        """The view of ``spec``'s tables: the stages asked for among ``available``,
        and ``--batch``, ``--head``, ``--rows`` and ``--keys`` within its shape.

        Raises:
            SpecError: naming the option that picks what the inputs do not have.
        """
        # imported here: keeps sdpa --help fast
        from sdpa_cli.render.common import View

        stages = parse_stages(self.stages, available)
        check_slice(spec.lead, self.batch, self.head)
        return View(
            stages=stages,
            batch=self.batch,
            head=self.head,
            rows=parse_rows(self.rows, spec.L),
            keys=parse_rows(self.keys, spec.S, "--keys", "keys"),
            max_rows=self.max_rows,
            max_slices=self.max_slices,
            precision=self.precision,
            width=width,
            explicit_stages=self.stages is not None,
        )


def view_options(*options: Option) -> Callable[[F], F]:
    """What a table shows (``options``, the command's choice of :class:`ViewFlags`),
    given to the command as ``view``."""
    return grouped("view", ViewFlags, options)


KEYS_OPTION = click.option(
    "--keys", metavar="I|START:STOP", help="Key columns to show (default from key 0)."
)
MAX_ROWS_OPTION = click.option(
    "--max-rows",
    metavar="N",
    type=click.IntRange(min=1),
    default=ViewFlags.max_rows,
    show_default=True,
    help="Most rows and columns per table (and keys listed in a scorecard).",
)
PRECISION_OPTION = click.option(
    "--precision",
    metavar="N",
    type=click.IntRange(0, 12),
    default=ViewFlags.precision,
    show_default=True,
    help="Digits after the point.",
)
BATCH_OPTION = click.option("--batch", type=int, metavar="B", help="Show only batch item B.")
HEAD_OPTION = click.option("--head", type=int, metavar="H", help="Show only head H.")
MAX_SLICES_OPTION = click.option(
    "--max-slices",
    metavar="N",
    type=click.IntRange(min=1),
    default=ViewFlags.max_slices,
    show_default=True,
    help="Most (batch, head) slices shown.",
)
STAGES_OPTION = click.option(
    "--stages",
    metavar="LIST",
    shell_complete=word_list(stage_names),
    help=f"Stages to show, comma-separated: {','.join(STAGES)} (default all that apply).",
)
ROWS_OPTION = click.option("--rows", metavar="I|START:STOP", help="Query rows to show.")
DISPLAY_OPTIONS = [
    STAGES_OPTION,
    BATCH_OPTION,
    HEAD_OPTION,
    ROWS_OPTION,
    KEYS_OPTION,
    MAX_ROWS_OPTION,
    MAX_SLICES_OPTION,
    PRECISION_OPTION,
]
"""``sdpa compute``'s view: every stage, slice, row and key."""


# --- the findings' thresholds -------------------------------------------------------------

THRESHOLD_FLAGS = ("saturation", "uniform", "head_fraction", "max_findings")


def diagnostic_options(f: F) -> F:
    """Thresholds of the findings; defaults from sdpa.yaml or [tool.sdpa] (README).
    The command receives them together, as ``thresholds`` (name → text or None);
    ``--config`` and ``--allow-outside`` are set for the run."""

    @functools.wraps(f)
    def command(*args: Any, **kwargs: Any) -> Any:
        # imported here: keeps sdpa --help fast
        from sdpa_cli.files.config import use_config
        from sdpa_cli.files.confine import allow_outside

        use_config(kwargs.pop("config"))
        allow_outside(kwargs.pop("allow_outside"))
        kwargs["thresholds"] = {name: kwargs.pop(name) for name in THRESHOLD_FLAGS}
        return f(*args, **kwargs)

    wrapped: Any = command
    for option in reversed(
        [
            click.option(
                "--saturation",
                metavar="P",
                help="Flag a row as one-hot when its largest weight is ≥ P (default 0.99); over "
                "2 keys also ≥ 0.9976, a gap random logits reach once in 50,000 rows.",
            ),
            click.option(
                "--uniform",
                metavar="F",
                help="Flag a row as near-uniform when its entropy is ≥ F · log(visible keys) "
                "(default 0.98) and random logits over as many keys are as flat in fewer than "
                "1 row of 50,000.",
            ),
            click.option(
                "--head-fraction",
                metavar="F",
                help="Flag a head when at least this fraction of its rows is flagged the same way: "
                "one-hot (collapsed head), near-uniform (dead head), or, in sdpa grad, vanishing "
                "(default 0.9).",
            ),
            click.option(
                "--max-findings",
                metavar="N",
                help="Row findings listed per kind; all are counted (default 50).",
            ),
            click.option(
                "--config",
                metavar="FILE",
                shell_complete=files,
                help="Read settings from FILE (sdpa.yaml, or a pyproject.toml's [tool.sdpa]) "
                "instead of the one found from here up to the repository's root.",
            ),
            click.option(
                "--allow-outside",
                is_flag=True,
                help="Let a case file, manifest or partials list name files outside its own "
                "folder (absolute paths, .., URLs); by default they are refused, so that a "
                "manifest from a pull request reads only its own tree.",
            ),
        ]
    ):
        wrapped = option(wrapped)
    return wrapped  # type: ignore[no-any-return]
