"""Options shared by several commands (decorators) and the helpers they need."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar

import click

from sdpa_cli.cli.attention import ATTENTION_OPTIONS as ATTENTION_OPTIONS
from sdpa_cli.cli.attention import attention_options as attention_options
from sdpa_cli.cli.completion import files, stage_names, word_list
from sdpa_cli.errors import SpecError
from sdpa_cli.names import STAGES

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from sdpa_cli.engine.spec import AttentionSpec

F = TypeVar("F", bound=Callable[..., Any])

EXIT_CODES_HELP = (
    "Exit codes: 0 success (a reader of stdout that leaves early, as | head, is no failure) · "
    "1 a check failed (sdpa check, sdpa grad --check-numeric) · 2 bad usage, bad input, or an output (stdout "
    "included) that cannot be written · 3 internal error (please report) · "
    "130 interrupted (Ctrl-C) · 143 SIGTERM · 129 SIGHUP."
)


COLOR_OPTION = click.option(
    "--color/--no-color",
    default=None,
    help="Force color on or off (default: on for a terminal, off with NO_COLOR).",
)


KEYS_OPTION = click.option(
    "--keys", metavar="I|START:STOP", help="Key columns to show (default from key 0)."
)


MAX_ROWS_OPTION = click.option(
    "--max-rows",
    metavar="N",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Most rows and columns per table (and keys listed in a scorecard).",
)
PRECISION_OPTION = click.option(
    "--precision",
    metavar="N",
    type=click.IntRange(0, 12),
    default=4,
    show_default=True,
    help="Digits after the point.",
)


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


FORMAT_OPTION = format_option(
    "Tables for a person, or one JSON/YAML object on stdout.", ("table", "json", "yaml")
)
JUNIT_OPTION = click.option(
    "--junit",
    metavar="FILE.xml",
    shell_complete=files,
    help="Also write a JUnit XML report, atomically.",
)


BATCH_OPTION = click.option("--batch", type=int, metavar="B", help="Show only batch item B.")
HEAD_OPTION = click.option("--head", type=int, metavar="H", help="Show only head H.")
MAX_SLICES_OPTION = click.option(
    "--max-slices",
    metavar="N",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Most (batch, head) slices shown.",
)


def display_options(f: F) -> F:
    """Which part of the computation to show, and how."""
    for option in reversed(
        [
            click.option(
                "--stages",
                metavar="LIST",
                shell_complete=word_list(stage_names),
                help=f"Stages to show, comma-separated: {','.join(STAGES)} (default all that apply).",
            ),
            BATCH_OPTION,
            HEAD_OPTION,
            click.option("--rows", metavar="I|START:STOP", help="Query rows to show."),
            KEYS_OPTION,
            MAX_ROWS_OPTION,
            MAX_SLICES_OPTION,
            PRECISION_OPTION,
            COLOR_OPTION,
        ]
    ):
        f = option(f)
    return f


THRESHOLD_FLAGS = ("saturation", "uniform", "head_fraction", "max_findings")


def diagnostic_options(f: F) -> F:
    """Thresholds of the findings; defaults from sdpa.yaml or [tool.sdpa] (README).
    The command receives them together, as ``given_thresholds`` (name → text or None)."""

    @functools.wraps(f)
    def command(*args: Any, **kwargs: Any) -> Any:
        # imported here: keeps sdpa --help fast
        from sdpa_cli.files.config import use_config
        from sdpa_cli.files.confine import allow_outside

        use_config(kwargs.pop("config"))
        allow_outside(kwargs.pop("allow_outside"))
        kwargs["given_thresholds"] = {name: kwargs.pop(name) for name in THRESHOLD_FLAGS}
        return f(*args, **kwargs)

    wrapped: Any = command
    for option in reversed(
        [
            click.option(
                "--saturation",
                metavar="P",
                help="Flag a row as one-hot when its largest weight is ≥ P (default 0.99).",
            ),
            click.option(
                "--uniform",
                metavar="F",
                help="Flag a row as near-uniform when its entropy is ≥ F · log(visible keys) (default 0.98).",
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


def output_options(f: F) -> F:
    """Machine-readable output."""
    f = click.option(
        "--save",
        metavar="FILE.npz",
        shell_complete=files,
        help="Write every stage (full shape) to FILE.npz, atomically.",
    )(f)
    return FORMAT_OPTION(f)


def export_options(what: str) -> Callable[[F], F]:
    """``--export-svg`` and ``--export-html``: ``what`` the tables show, also written
    as a picture or a page (in color, at the terminal's width), atomically."""

    def decorate(f: F) -> F:
        for name, kind in (("html", "an HTML page"), ("svg", "an SVG picture")):
            f = click.option(
                f"--export-{name}",
                metavar=f"FILE.{name}",
                shell_complete=files,
                help=f"Also write {what} as {kind}.",
            )(f)
        return f

    return decorate


def export_outputs(svg: str | None, html: str | None) -> list[tuple[str, str | None]]:
    """The exports as :func:`~sdpa_cli.files.outputs.check_outputs` takes outputs."""
    return [("--export-svg", svg), ("--export-html", html)]


def exports(
    renderables: Sequence[RenderableType],
    width: int,
    svg: str | None,
    html: str | None,
    title: str,
) -> list[tuple[str, Callable[[BinaryIO], None]]]:
    """The writers of ``--export-svg`` and ``--export-html`` (those asked for), for
    :func:`~sdpa_cli.files.writers.write_all_atomic`: ``renderables`` recorded in full
    color, whatever stdout is; the SVG titled ``title``."""
    if not svg and not html:
        return []
    # imported here: keeps sdpa --help fast
    from rich.console import Console

    recorder = Console(
        file=io.StringIO(), record=True, width=width, force_terminal=True, color_system="truecolor"
    )
    for renderable in renderables:
        recorder.print(renderable)
    texts = []
    if svg:
        texts.append((svg, recorder.export_svg(title=title, clear=False)))
    if html:
        texts.append((html, recorder.export_html(clear=False)))
    return [(path, _writes_text(text)) for path, text in texts]


def _writes_text(text: str) -> Callable[[BinaryIO], None]:
    """A writer of ``text`` in UTF-8."""

    def write(fh: BinaryIO) -> None:
        fh.write(text.encode("utf-8"))

    return write


# --- helpers --------------------------------------------------------------------------


JOBS_OPTION = click.option(
    "--jobs",
    type=click.IntRange(min=1),
    metavar="N",
    help="Threads computing blocks (default: the number of cores).",
)

BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def start_engine(jobs: int | None) -> int:
    """The engine's thread count; BLAS kept to one thread per engine thread: through
    the environment when numpy has not loaded yet (BLAS reads it at load), else at run
    time (:func:`_one_blas_thread`). A thread count the user set wins."""
    # imported here: the standard library only, and keeps sdpa --help fast
    from sdpa_cli.files.limits import check_address_space, keep_freed_blocks

    n = jobs or cores()
    check_address_space(n)
    chosen = any(name in os.environ for name in BLAS_THREADS)
    for name in BLAS_THREADS:
        os.environ.setdefault(name, "1")
    if not chosen and "numpy" in sys.modules:
        _one_blas_thread()
    keep_freed_blocks()
    return n


def _one_blas_thread() -> None:
    """BLAS to one thread now, numpy being loaded already (reading a config file or
    an input may load it): a BLAS thread pool per engine thread oversubscribes the
    cores, and ran ``check`` 1.6× slower on two cores than one BLAS thread each."""
    try:
        # imported here: only once the engine starts, and it is optional
        from threadpoolctl import threadpool_limits
    except ImportError:  # installed with sdpa; without it BLAS keeps its threads
        return
    threadpool_limits(limits=1, user_api="blas")


PROGRESS_SCORES = 1 << 27
"""Scores above which a run takes more than about a second: a progress bar is shown."""


@contextlib.contextmanager
def progress_bar(spec: AttentionSpec, what: str) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr over the scores of ``spec``, when stderr is a terminal
    and the work long enough to want one; yields the callback the engine calls."""
    total = math.prod(spec.weights_shape)
    if total < PROGRESS_SCORES or not sys.stderr.isatty() or os.environ.get("CI"):
        yield None
        return
    # imported here: keeps sdpa --help fast
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    console = make_console(None, stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n: bar.advance(task, n)


def make_console(color: bool | None, *, stderr: bool = False) -> Console:
    """A console on stdout (results) or stderr (messages); color only on a terminal."""
    # imported here: keeps sdpa --help fast
    from rich.console import Console

    if color is True:
        return Console(stderr=stderr, force_terminal=True, no_color=False, highlight=False)
    if color is False or os.environ.get("NO_COLOR"):
        # No escape codes at all: not even bold or italic (rich's NO_COLOR keeps those).
        return Console(stderr=stderr, no_color=True, highlight=False, color_system=None)
    return Console(stderr=stderr, highlight=False)


def print_all(console: Console, renderables: Sequence[RenderableType]) -> None:
    """Print renderables; without color, as plain lines with no trailing spaces
    (rich pads table cells and wrapped lines to their width)."""
    if console.is_terminal and console.color_system is not None:
        for renderable in renderables:
            console.print(renderable)
        return
    with console.capture() as captured:
        for renderable in renderables:
            console.print(renderable)
    lines = captured.get().splitlines()
    console.file.write("".join(line.rstrip() + "\n" for line in lines))
    console.file.flush()


def parse_rows(
    text: str | None, n: int, option: str = "--rows", what: str = "query rows"
) -> slice | None:
    """``I`` or ``START:STOP`` (either may be empty) → a slice within 0..n."""
    if text is None:
        return None
    if not n:
        raise SpecError(option, f"there are no {what} to pick (0 of them)")
    try:
        if ":" in text:
            a, _, b = text.partition(":")
            start = int(a) if a.strip() else 0
            stop = int(b) if b.strip() else n
        else:
            start = int(text)
            stop = start + 1
    except ValueError:
        raise SpecError(option, f"expected I or START:STOP, got {text!r}") from None
    if not (0 <= start < stop <= n):
        raise SpecError(option, f"{text!r} is outside the {n} {what} (0..{n - 1})")
    return slice(start, stop)


def parse_stages(text: str | None, available: tuple[str, ...]) -> tuple[str, ...]:
    """``--stages raw,weights`` → the stage names, checked; ``available`` when not given."""
    if text is None:
        return available
    chosen = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in chosen if s not in STAGES]
    if unknown or not chosen:
        raise SpecError(
            "--stages",
            f"unknown stage {unknown[0] if unknown else text!r}; choose from {', '.join(STAGES)}",
        )
    return chosen


def check_index(option: str, value: int | None, size: int | None, what: str) -> None:
    if value is None:
        return
    if size is None:
        raise SpecError(option, f"the inputs have no {what} axis")
    if not 0 <= value < size:
        raise SpecError(
            option, f"{value} is out of range: the inputs have {size} {what}s (0..{size - 1})"
        )
