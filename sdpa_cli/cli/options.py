"""Options shared by several commands (decorators) and the helpers they need."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from sdpa_cli.errors import SpecError

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from sdpa_cli.engine.spec import AttentionSpec

F = TypeVar("F", bound=Callable[..., Any])

EXIT_CODES_HELP = (
    "Exit codes: 0 success (a reader of stdout that leaves early, as | head, is no failure) · "
    "1 a check failed (sdpa check) · 2 bad usage, bad input, or an output (stdout "
    "included) that cannot be written · 3 internal error (please report) · "
    "130 interrupted (Ctrl-C) · 143 SIGTERM · 129 SIGHUP."
)


ATTENTION_OPTIONS: list[Callable[[F], F]] = [
    click.option(
        "--scale",
        metavar="sqrt-dk|dk|none|X",
        help="Factor on Q·Kᵀ: 1/√E (sqrt-dk, default), 1/E (dk), 1 (none) or a number.",
    ),
    click.option("--temperature", metavar="T", help="Divide the scaled scores by T (default 1)."),
    click.option(
        "--softcap",
        metavar="C",
        help="Soft-cap the logits: C·tanh(x/C), as Gemma 2 and FlashAttention.",
    ),
    click.option(
        "--bias", "bias_path", metavar="FILE", help="Additive bias, broadcastable to (..., L, S)."
    ),
    click.option(
        "--sinks",
        "sinks_path",
        metavar="FILE",
        help="Attention sinks (gpt-oss): one logit per query head, (H,) or (1,), joining every row's softmax as an extra column that V does not read.",
    ),
    click.option(
        "--segment-ids",
        "segment_ids_path",
        metavar="FILE",
        help="Segment (document) ids, integers (L,) or (B, L), as JAX's: a query sees only keys of its own id; they serve the keys too unless --segment-ids-kv.",
    ),
    click.option(
        "--segment-ids-kv",
        "segment_ids_kv_path",
        metavar="FILE",
        help="The keys' segment ids, (S,) or (B, S) (default: --segment-ids).",
    ),
    click.option("--alibi/--no-alibi", default=None, help="Add ALiBi: −slope_h·|i + S − L − j|."),
    click.option("--causal/--no-causal", default=None, help="Hide future keys."),
    click.option(
        "--causal-align",
        type=click.Choice(["upper-left", "lower-right"]),
        help="Diagonal of the causal mask and window when L ≠ S (default upper-left, as PyTorch is_causal; lower-right as FlashAttention).",
    ),
    click.option(
        "--mask",
        "mask_path",
        metavar="FILE",
        help="Boolean mask (True = may attend) or float mask (added to the logits), broadcastable to (..., L, S).",
    ),
    click.option(
        "--mask-true-means",
        type=click.Choice(["attend", "masked"]),
        help="What True means in a boolean mask (default attend, as PyTorch).",
    ),
    click.option(
        "--key-lengths",
        metavar="N[,N...]",
        help="Valid keys per batch item (the rest is padding); one number for all.",
    ),
    click.option(
        "--query-offset",
        metavar="N[,N...]",
        help="KV-cache step: position of query 0 per batch item (the cache length before the new tokens); causal, window and ALiBi see query i at N + i. One number for all.",
    ),
    click.option(
        "--query-lengths",
        metavar="N[,N...]",
        help="Valid queries per batch item; later rows are absent: zero output, not judged, not compared. One number for all.",
    ),
    click.option(
        "--cu-seqlens",
        metavar="0,N1,...,L",
        help="Packed documents (FlashAttention's varlen): cumulative lengths along L; a query sees only its document's keys. Batch of 1.",
    ),
    click.option(
        "--cu-seqlens-k",
        metavar="0,N1,...,S",
        help="The documents' cumulative lengths along S (default: --cu-seqlens).",
    ),
    click.option(
        "--window",
        metavar="W|LEFT,RIGHT",
        help="Sliding window: key j visible to query i when −LEFT ≤ j − i − offset ≤ RIGHT.",
    ),
    click.option(
        "--mask-mod",
        metavar="EXPR",
        help='FlexAttention\'s mask_mod: an expression over b, h, q_idx, kv_idx; where it is false the key is hidden, e.g. "q_idx >= kv_idx and q_idx - kv_idx < 256".',
    ),
    click.option(
        "--score-mod",
        metavar="EXPR",
        help='FlexAttention\'s score_mod: an expression over score (the scaled score), b, h, q_idx, kv_idx giving the logit before the mask, e.g. "score + 0.1 * (kv_idx - q_idx)". Numbers, + - * / // % **, comparisons, and/or/not, where, abs, tanh, exp, log, sqrt, minimum, maximum.',
    ),
    click.option(
        "--mask-value",
        metavar="-inf|finfo-min|X",
        help="Value of hidden logits (default -inf; e.g. -1e9 as many kernels use).",
    ),
    click.option(
        "--dropout", metavar="P", help="Inverted dropout on the weights with probability P."
    ),
    click.option("--seed", metavar="N", help="Seed of the dropout mask (default 0)."),
    click.option(
        "--dropout-mask",
        "dropout_mask_path",
        metavar="FILE",
        help="Dropout's keep mask (bool or 0/1, broadcastable to (..., L, S)) replayed in place of the drawn one; needs --dropout.",
    ),
    click.option(
        "--heads",
        metavar="N",
        help="Split (..., L, d_model) inputs into N heads; the output is merged back.",
    ),
    click.option(
        "--kv-heads",
        metavar="G",
        help="With --heads: K and V hold G heads (d_model_kv = G·E), as ONNX's 3-D Attention inputs (grouped-query attention).",
    ),
    click.option(
        "--layout",
        type=click.Choice(["bhsd", "bshd"]),
        help="Axes of Q, K, V and the output: bhsd (B, H, L, E), default, as PyTorch; bshd (B, L, H, E), as FlashAttention and xformers (read through a transposing view; the output is returned so).",
    ),
    click.option(
        "--dtype",
        metavar="FORMAT",
        help="Run as a kernel in FORMAT: float64 (default, exact), float32, float16, bfloat16, float8_e4m3fn, float8_e5m2; reports the error against float64.",
    ),
    click.option(
        "--accumulate",
        metavar="FORMAT",
        help="Accumulator of both matmuls under --dtype: float32 (default, as tensor cores), float64, or the --dtype format (same).",
    ),
    click.option(
        "--softmax-dtype",
        metavar="FORMAT",
        help="Format the softmax runs in under --dtype: float32 (default), float64, or the --dtype format (same).",
    ),
    click.option(
        "--logits-dtype",
        metavar="FORMAT",
        help="Format scores and logits are stored in under --dtype: the --dtype format (same, default, as PyTorch's unfused path) or float32 (as fused kernels).",
    ),
    click.option(
        "--prescale/--no-prescale",
        default=None,
        help="Scale Q and K by √scale before the matmul (ONNX's guard against overflow).",
    ),
    click.option(
        "--as",
        "framework",
        type=click.Choice(["torch", "flash", "jax", "onnx", "hf"]),
        help="Use a framework's conventions, as defaults flags override: causal alignment "
        "when L ≠ S (torch, jax upper-left; flash, onnx, hf lower-right), the mask value "
        "(jax −0.7·finfo(float32).max, hf finfo-min, else -inf: a row with no visible key "
        "gives the mean of V or zeros), --window's LEFT read as hf's sliding_window "
        "(counting the query).",
    ),
]


def attention_options(f: F) -> F:
    """The computation options every command shares (``compute``, ``explain``, ...)."""
    for option in reversed(ATTENTION_OPTIONS):
        f = option(f)
    return f


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
    "--junit", metavar="FILE.xml", help="Also write a JUnit XML report, atomically."
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
                help="Stages to show, comma-separated: raw,scaled,capped,biased,masked,weights,dropped,output (default all that apply).",
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

        use_config(kwargs.pop("config"))
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
                help="Flag a head as dead or collapsed when this fraction of its rows is (default 0.9).",
            ),
            click.option(
                "--max-findings",
                metavar="N",
                help="Row findings listed per kind; all are counted (default 50).",
            ),
            click.option(
                "--config",
                metavar="FILE",
                help="Read settings from FILE (sdpa.yaml, or a pyproject.toml's [tool.sdpa]) "
                "instead of the one found from here up to the repository's root.",
            ),
        ]
    ):
        wrapped = option(wrapped)
    return wrapped  # type: ignore[no-any-return]


def output_options(f: F) -> F:
    """Machine-readable output."""
    f = click.option(
        "--save", metavar="FILE.npz", help="Write every stage (full shape) to FILE.npz, atomically."
    )(f)
    return FORMAT_OPTION(f)


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
    """The engine's thread count; BLAS kept to one thread per worker. Called before
    numpy is first imported (BLAS reads these at load); a variable the user set wins."""
    n = jobs or cores()
    for name in BLAS_THREADS:
        os.environ.setdefault(name, "1")
    _keep_freed_blocks()
    return n


def _keep_freed_blocks() -> None:
    """Have glibc keep freed block-sized arrays for reuse. By default it hands every
    freed allocation above 128 KiB back to the system and maps the next one afresh,
    a page fault per 4 KiB of every array of every block: a third of a run's time."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes  # imported here: only glibc needs it, and it keeps sdpa --help fast

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: map only allocations above 32 MiB
        libc.mallopt(-1, 16 << 20)  # M_TRIM_THRESHOLD: keep up to 16 MiB of freed heap
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


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
    # imported here: keeps sdpa --help fast (the engine imports numpy)
    from sdpa_cli.engine.block import STAGES

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
