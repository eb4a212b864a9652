"""What every command does around its one call into the API: the engine started (its
threads, BLAS kept to one thread each), a progress bar watching it, the consoles it
prints on, and the pictures of its tables (``--export-svg``, ``--export-html``).

Only the standard library and click at the top, so that ``sdpa --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from sdpa_cli.api.outputs import PICTURES, Outputs
from sdpa_cli.text import si

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.progress import Progress, ProgressColumn, Task

    from sdpa_cli.cli.options import ViewFlags
    from sdpa_cli.diagnosis.findings import Diagnosis
    from sdpa_cli.engine.arrays import Backend
    from sdpa_cli.engine.spec import AttentionSpec
    from sdpa_cli.files.writers import Writer

BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def start_engine(computing: tuple[int | None, str | None, str | None]) -> int:
    """The engine's thread count; BLAS kept to one thread per engine thread: through
    the environment when numpy has not loaded yet (BLAS reads it at load), else at run
    time (:func:`_one_blas_thread`). A thread count the user set wins. ``computing``:
    ``--jobs``, ``--backend`` and ``--device``; the blocks are computed by the backend
    on the device (the flags, else the config file's ``backend`` and ``device``, else
    numpy)."""
    # imported here: the standard library only, and keeps sdpa --help fast
    from sdpa_cli.files.limits import check_address_space, cores, keep_freed_blocks

    jobs, backend, device = computing
    n = jobs or cores()
    check_address_space(n)
    chosen = any(name in os.environ for name in BLAS_THREADS)
    for name in BLAS_THREADS:
        os.environ.setdefault(name, "1")
    if not chosen and "numpy" in sys.modules:
        _one_blas_thread()
    keep_freed_blocks()
    chosen_backend = _use_backend(backend, device)  # after BLAS's threads: this loads numpy
    if chosen_backend.name == "torch" and not chosen:
        # torch read OMP_NUM_THREADS=1, set above for numpy's BLAS; its blocks run one at
        # a time, each over the engine's threads (it ran on one core)
        import torch

        torch.set_num_threads(n)
    return n


def _use_backend(backend: str | None, device: str | None) -> Backend:
    """The flags over the config file's ``backend`` and ``device``, resolved (torch
    imported, the device found) and used for the command's run."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.engine.arrays import resolve, use
    from sdpa_cli.errors import SpecError
    from sdpa_cli.files.config import read_config

    source, raw = read_config()
    flags = {"backend": backend, "device": device}
    configured = {k: raw[k] for k, v in flags.items() if v is None and k in raw}
    for key, value in configured.items():
        if not isinstance(value, str):
            raise SpecError(f"{source}: {key}", f"expected text, got {type(value).__name__}")
    given = {**flags, **configured}
    try:
        chosen = resolve(given["backend"] or "auto", given["device"])
    except SpecError as e:  # a value from the config file is named as its key there
        key = e.where.removeprefix("--")
        if key in configured:
            raise SpecError(f"{source}: {key}", e.problem) from None
        raise
    use(chosen)
    return chosen


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
    and the work long enough to want one; yields the callback the engine calls. The
    API's :data:`~sdpa_cli.api.case.Watch`."""
    total = math.prod(spec.weights_shape)
    if total < PROGRESS_SCORES or not sys.stderr.isatty() or os.environ.get("CI"):
        yield None
        return
    console = make_console(None, stderr=True)
    with progress_display(console) as bar:
        task = bar.add_task(what, total=total)

        def advance(n: int) -> None:
            bar.advance(task, n)
            if bar.tasks[0].finished:  # the pass is done: what follows is not its time
                bar.stop()

        yield advance


def progress_display(console: Console, clock: Callable[[], float] | None = None) -> Progress:
    """The bar: what runs, how far (a percentage), how fast (scores a second, since the
    start) and how long is left at that pace. The average since the start, not rich's
    speed over the last seconds: a pass's blocks differ (a causal diagonal's), and an
    estimate from the last few swings (0:00:28 → 0:00:58 → 0:00:46); this one settles.
    ``clock``: the time source (tests give one)."""
    # imported here: keeps sdpa --help fast
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        _rate_column(),
        _eta_column(),
    )
    return Progress(*columns, console=console, transient=True, get_time=clock)


def _rate_column() -> ProgressColumn:
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        """Scores a second, since the start."""

        def render(self, task: Task) -> Text:
            elapsed = task.elapsed or 0.0
            if not task.completed or elapsed <= 0:
                return Text("", style="progress.data.speed")
            return Text(f"{si(task.completed / elapsed)} scores/s", style="progress.data.speed")

    return Rate()


def _eta_column() -> ProgressColumn:
    from rich.progress import ProgressColumn
    from rich.text import Text

    class Eta(ProgressColumn):
        """The time left at the average pace since the start."""

        def render(self, task: Task) -> Text:
            elapsed = task.elapsed or 0.0
            if not task.completed or elapsed <= 0 or task.total is None:
                return Text("left …", style="progress.remaining")
            left = elapsed * (task.total - task.completed) / task.completed
            m, s = divmod(round(max(left, 0.0)), 60)
            h, m = divmod(m, 60)
            return Text(f"{h}:{m:02d}:{s:02d} left", style="progress.remaining")

    return Eta()


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


def pictures(
    outputs: Outputs, renderables: Sequence[RenderableType], width: int, title: str
) -> dict[str, Writer]:
    """The writers of the pictures ``outputs`` asks for (``svg``, ``html``), for
    :func:`~sdpa_cli.api.outputs.write_outputs`: ``renderables`` recorded in full
    color at ``width``, whatever stdout is; the SVG titled ``title``."""
    if not outputs.wants(*PICTURES):
        return {}
    # imported here: keeps sdpa --help fast
    from rich.console import Console

    recorder = Console(
        file=io.StringIO(), record=True, width=width, force_terminal=True, color_system="truecolor"
    )
    for renderable in renderables:
        recorder.print(renderable)
    texts = {
        "svg": recorder.export_svg(title=title, clear=False) if "svg" in outputs else "",
        "html": recorder.export_html(clear=False) if "html" in outputs else "",
    }
    return {kind: _writes_text(text) for kind, text in texts.items() if kind in outputs}


def slice_page(
    command: str,
    spec: AttentionSpec,
    diagnosis: Diagnosis,
    view: ViewFlags,
    inputs: Sequence[str],
    renderables: Sequence[RenderableType],
    tokens: str | None,
    threads: int,
) -> Writer:
    """``--html`` of ``compute`` and ``explain``: the page of the slice ``--batch``,
    ``--head`` (default the first), its window ``--rows`` × ``--keys`` (default: all),
    with what the terminal shows."""
    # imported here: keeps sdpa --help fast
    from sdpa_cli.api.outputs import text_file
    from sdpa_cli.api.pages import slice_page_of

    at = (view.batch or 0, view.head or 0)
    page = slice_page_of(
        spec,
        diagnosis,
        at,
        rows=view.rows,
        keys=view.keys,
        title=f"sdpa {command}: {' '.join(inputs)}",
        about=f"batch {at[0]}, head {at[1]}",
        text=plain_text(renderables),
        tokens=tokens,
        jobs=threads,
    )
    return text_file(page)


def plain_text(renderables: Sequence[RenderableType], width: int = 100) -> str:
    """``renderables`` as the terminal shows them, in plain text (a page's copy)."""
    # imported here: keeps sdpa --help fast
    from rich.console import Console

    recorder = Console(file=io.StringIO(), record=True, width=width, color_system=None)
    for renderable in renderables:
        recorder.print(renderable)
    return recorder.export_text()


def _writes_text(text: str) -> Writer:
    """A writer of ``text`` in UTF-8."""
    return lambda fh: fh.write(text.encode("utf-8"))
