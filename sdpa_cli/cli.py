"""The command line: click commands, shared option decorators, consoles, exit codes.

The only module that imports click. Everything heavy (numpy, rich, yaml) is imported
inside the commands, so ``sdpa --help`` starts instantly.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import click

from sdpa_cli import __version__
from sdpa_cli.errors import ExitCode, SdpaError, SpecError

if TYPE_CHECKING:
    from rich.console import Console

    from sdpa_cli.spec import AttentionSpec

F = TypeVar("F", bound=Callable[..., Any])

EXIT_CODES_HELP = (
    "Exit codes: 0 success · 1 a check failed (sdpa check) · 2 bad usage or bad input · "
    "3 internal error (please report) · 130 interrupted."
)


class SdpaGroup(click.Group):
    """A group whose errors are one line on stderr with the right exit code."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        code: int
        try:
            result = super().main(
                argv, prog_name or "sdpa", complete_var, standalone_mode=False, **extra
            )
            code = result if isinstance(result, int) else ExitCode.OK
        except SdpaError as exc:
            code = _fail(str(exc), ExitCode.BAD_INPUT)
        except click.exceptions.Abort:
            code = _fail("interrupted", ExitCode.INTERRUPTED)
        except KeyboardInterrupt:
            code = _fail("interrupted", ExitCode.INTERRUPTED)
        except click.ClickException as exc:
            code = _fail(exc.format_message(), ExitCode.BAD_INPUT)
        except BrokenPipeError:
            code = ExitCode.OK  # the reader went away (| head): not an error
        except Exception as exc:  # a bug: one line, the traceback only with --debug
            if "--debug" in argv:
                traceback.print_exc()
            code = _fail(
                f"internal error: {type(exc).__name__}: {exc} "
                "(a bug in sdpa; please report it, with --debug for the traceback)",
                ExitCode.INTERNAL,
            )
        if standalone_mode:
            sys.exit(int(code))
        return int(code)


def _fail(message: str, code: ExitCode) -> ExitCode:
    click.echo(f"sdpa: error: {message}", err=True)
    return code


@click.group(
    cls=SdpaGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES_HELP,
)
@click.version_option(__version__, "--version", "-V", prog_name="sdpa")
@click.option("--debug", is_flag=True, help="Show the traceback of an internal error.")
def cli(debug: bool) -> None:
    """Inspect scaled dot-product attention, softmax(Q·Kᵀ·scale + bias + mask)·V, stage by stage.

    \b
    Example:
      sdpa compute samples/scorecard.yaml
      sdpa compute q.npy k.npy v.npy --causal --format json
    """


# --- shared option decorators ---------------------------------------------------------

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
        "--window",
        metavar="W|LEFT,RIGHT",
        help="Sliding window: key j visible to query i when −LEFT ≤ j − i − offset ≤ RIGHT.",
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
        "--heads",
        metavar="N",
        help="Split (..., L, d_model) inputs into N heads; the output is merged back.",
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
]


def attention_options(f: F) -> F:
    """The computation options every command shares (``compute``, ``explain``, ...)."""
    for option in reversed(ATTENTION_OPTIONS):
        f = option(f)
    return f


def display_options(f: F) -> F:
    """Which part of the computation to show, and how."""
    for option in reversed(
        [
            click.option(
                "--stages",
                metavar="LIST",
                help="Stages to show, comma-separated: raw,scaled,capped,biased,masked,weights,dropped,output (default all that apply).",
            ),
            click.option("--batch", type=int, metavar="B", help="Show only batch item B."),
            click.option("--head", type=int, metavar="H", help="Show only head H."),
            click.option("--rows", metavar="I|START:STOP", help="Query rows to show."),
            click.option(
                "--max-rows",
                metavar="N",
                type=click.IntRange(min=1),
                default=16,
                show_default=True,
                help="Most rows and columns per table.",
            ),
            click.option(
                "--max-slices",
                metavar="N",
                type=click.IntRange(min=1),
                default=1,
                show_default=True,
                help="Most (batch, head) slices shown.",
            ),
            click.option(
                "--precision",
                metavar="N",
                type=click.IntRange(0, 12),
                default=4,
                show_default=True,
                help="Digits after the point.",
            ),
            click.option(
                "--color/--no-color",
                default=None,
                help="Force color on or off (default: on for a terminal, off with NO_COLOR).",
            ),
        ]
    ):
        f = option(f)
    return f


def diagnostic_options(f: F) -> F:
    """Thresholds of the findings; defaults from sdpa.yaml or [tool.sdpa] (README)."""
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
        ]
    ):
        f = option(f)
    return f


def output_options(f: F) -> F:
    """Machine-readable output."""
    f = click.option(
        "--save", metavar="FILE.npz", help="Write every stage (full shape) to FILE.npz, atomically."
    )(f)
    f = click.option(
        "--format",
        "fmt",
        type=click.Choice(["table", "json", "yaml"]),
        default="table",
        show_default=True,
        help="Tables for a person, or one JSON/YAML object on stdout.",
    )(f)
    return f


# --- helpers --------------------------------------------------------------------------


def make_console(color: bool | None, *, stderr: bool = False) -> Console:
    """A console on stdout (results) or stderr (messages); color only on a terminal."""
    from rich.console import Console

    if color is True:
        return Console(stderr=stderr, force_terminal=True, no_color=False, highlight=False)
    if color is False or os.environ.get("NO_COLOR"):
        # No escape codes at all: not even bold or italic (rich's NO_COLOR keeps those).
        return Console(stderr=stderr, no_color=True, highlight=False, color_system=None)
    return Console(stderr=stderr, highlight=False)


def load_spec(
    inputs: tuple[str, ...], bias_path: str | None, mask_path: str | None, flags: dict[str, Any]
) -> tuple[AttentionSpec, str | None]:
    """Files and flags → a validated spec (and the case file's description, if any).

    One input is a case file; three are Q, K and V. Flags override the case file.
    """
    from sdpa_cli.loaders import is_case_file, load_array, load_case
    from sdpa_cli.spec import OPTION_NAMES, build_spec, parse_options

    tensors: dict[str, Any] = {}
    names: dict[str, str] = {}
    raw: dict[str, Any] = {}
    where: dict[str, str] = {}
    description = None
    if len(inputs) == 1:
        if not is_case_file(inputs[0]):
            raise SpecError(
                inputs[0],
                "one input must be a case file (.yaml or .json holding q, k, v); otherwise give Q K V",
            )
        case = load_case(inputs[0], OPTION_NAMES)
        tensors, names, raw, where = (
            dict(case.tensors),
            dict(case.sources),
            dict(case.options),
            dict(case.where),
        )
        description = case.description
    elif len(inputs) == 3:
        for key, path in zip(("q", "k", "v"), inputs, strict=True):
            tensors[key] = load_array(path, name=key)
            names[key] = path
    else:
        raise SpecError(
            " ".join(inputs),
            f"expected Q K V (three files) or one case file, got {len(inputs)} inputs",
        )
    for key, extra in (("bias", bias_path), ("mask", mask_path)):
        if extra is not None:
            tensors[key] = load_array(extra, name=key)
            names[key] = extra
    for name, value in flags.items():
        if value is not None:
            raw[name] = value
            where.pop(name, None)  # a flag is named by its spelling, --causal-align
    options = parse_options(raw, where)
    spec = build_spec(
        tensors["q"],
        tensors["k"],
        tensors["v"],
        bias=tensors.get("bias"),
        mask=tensors.get("mask"),
        options=options,
        names=names,
    )
    return spec, description


def parse_rows(text: str | None, L: int) -> slice | None:
    """``I`` or ``START:STOP`` (either may be empty) → a slice within 0..L."""
    if text is None:
        return None
    try:
        if ":" in text:
            a, _, b = text.partition(":")
            start = int(a) if a.strip() else 0
            stop = int(b) if b.strip() else L
        else:
            start = int(text)
            stop = start + 1
    except ValueError:
        raise SpecError("--rows", f"expected I or START:STOP, got {text!r}") from None
    if not (0 <= start < stop <= L):
        raise SpecError("--rows", f"{text!r} is outside the {L} query rows (0..{L - 1})")
    return slice(start, stop)


def parse_stages(text: str | None, available: tuple[str, ...]) -> tuple[str, ...]:
    from sdpa_cli.compute import STAGES

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


# --- commands -------------------------------------------------------------------------


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("inputs", nargs=-1, required=True, metavar="Q K V | CASE")
@attention_options
@diagnostic_options
@display_options
@output_options
def compute(
    inputs: tuple[str, ...],
    bias_path: str | None,
    mask_path: str | None,
    stages: str | None,
    batch: int | None,
    head: int | None,
    rows: str | None,
    max_rows: int,
    max_slices: int,
    precision: int,
    color: bool | None,
    fmt: str,
    save: str | None,
    saturation: str | None,
    uniform: str | None,
    head_fraction: str | None,
    max_findings: str | None,
    **flags: Any,
) -> None:
    """Compute attention and show every stage: raw, scaled and masked scores, weights, output.

    Inputs are three files Q K V (.npy, .npz[:name], .json, .yaml) or one case file
    holding q, k, v and options. Flags override the case file.

    \b
    Examples:
      sdpa compute samples/scorecard.yaml
      sdpa compute samples/causal.yaml --stages masked,weights --format json
      sdpa compute q.npy k.npy v.npy --causal --causal-align lower-right --save trace.npz
      sdpa compute q.npy k.npy v.npy --dtype float16
    """
    from sdpa_cli.compute import applicable_stages, trace
    from sdpa_cli.config import thresholds
    from sdpa_cli.diagnose import diagnose
    from sdpa_cli.render import View, render_compute
    from sdpa_cli.report import payload, save_npz, to_json, to_yaml

    limits = thresholds(
        {
            "saturation": saturation,
            "uniform": uniform,
            "head_fraction": head_fraction,
            "max_findings": max_findings,
        }
    )
    spec, description = load_spec(inputs, bias_path, mask_path, flags)
    chosen = parse_stages(stages, applicable_stages(spec))
    check_index("--head", head, spec.lead[-1] if spec.lead else None, "head")
    check_index("--batch", batch, spec.lead[-2] if len(spec.lead) >= 2 else None, "batch item")
    row_slice = parse_rows(rows, spec.L)

    # Keep only the stages shown, unless --save asks for every one.
    result = trace(spec, stages=None if save is not None else chosen)
    diagnosis = diagnose(result, limits)
    # Everything is rendered before the --save file is written, so a failure while
    # rendering cannot leave a new file behind; the output is printed last.
    console = make_console(color)
    text: str | None = None
    renderables: list[Any] = []
    if fmt == "json":
        text = to_json(payload(result, chosen, diagnosis, for_json=True)) + "\n"
    elif fmt == "yaml":
        text = to_yaml(payload(result, chosen, diagnosis, for_json=False))
    else:
        from rich.text import Text

        view = View(
            stages=chosen,
            batch=batch,
            head=head,
            rows=row_slice,
            max_rows=max_rows,
            max_slices=max_slices,
            precision=precision,
            width=console.width,
            explicit_stages=stages is not None,
        )
        if description:
            renderables.append(Text(description.strip(), style="italic"))
        renderables.append(render_compute(result, view, diagnosis))
    if save is not None:
        save_npz(result, save)
    if text is not None:
        click.echo(text, nl=False)
    for renderable in renderables:
        console.print(renderable)


def main(args: Sequence[str] | None = None, prog_name: str = "sdpa") -> None:
    """The console-script entry point."""
    cli.main(args=args, prog_name=prog_name)
