"""The command line: the ``sdpa`` group, its commands, and errors → exit codes.

The only package that imports click. Everything heavy (numpy, rich, yaml) is imported
inside the commands, so ``sdpa --help`` starts instantly. One module per command;
shared option decorators and helpers live in :mod:`sdpa_cli.cli.options`.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import click

from sdpa_cli._version import __version__
from sdpa_cli.cli.capture import capture
from sdpa_cli.cli.check import check
from sdpa_cli.cli.compute import compute
from sdpa_cli.cli.explain import explain
from sdpa_cli.cli.grad import grad
from sdpa_cli.cli.inspect import inspect
from sdpa_cli.cli.options import EXIT_CODES_HELP
from sdpa_cli.cli.report import report
from sdpa_cli.errors import ExitCode, SdpaError


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
        # Overflow, NaN and inf are what the findings report, with where they happened;
        # numpy's RuntimeWarnings would say it again on stderr, without the where.
        warnings.simplefilter("ignore", RuntimeWarning)
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
      sdpa explain samples/scorecard.yaml --query 0
      sdpa grad samples/scorecard.yaml --check-numeric
      sdpa inspect samples/cross.npz
    """


cli.add_command(compute)
cli.add_command(explain)
cli.add_command(check)
cli.add_command(grad)
cli.add_command(inspect)
cli.add_command(report)
cli.add_command(capture)


def main(args: Sequence[str] | None = None, prog_name: str = "sdpa") -> None:
    """The console-script entry point."""
    cli.main(args=args, prog_name=prog_name)
