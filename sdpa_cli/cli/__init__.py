"""The command line: the ``sdpa`` group, its commands, and errors → exit codes.

The only package that imports click. Everything heavy (numpy, rich, yaml) is imported
inside the commands, so ``sdpa --help`` starts instantly. One module per command;
shared option decorators and helpers live in :mod:`sdpa_cli.cli.options`; the
process's streams and signals in :mod:`sdpa_cli.cli.streams`.

Exit codes (:class:`~sdpa_cli.errors.ExitCode`, and ``EXIT_CODES_HELP`` beside it):

- a broken pipe on stdout (``sdpa ... | head -1``) is not a failure: the reader took
  what it wanted. The run exits 0, or with the verdict the command had reached before
  it printed (``check``'s 1 for a failed check, :func:`~sdpa_cli.cli.streams.decided`),
  never click's 1 for the pipe itself (under ``set -o pipefail`` that reads as a failed
  check). Not the shell's 141: a pipeline that ends early is how ``head`` is used;
- stdout that cannot be written (a full disk, an I/O error) exits 2 with one line,
  ``sdpa: error: stdout: cannot be written: ...``, as any output that cannot be; no
  stdout at all (``>&-``) exits 2 before anything runs;
- SIGTERM and SIGHUP exit 128 + the signal (143, 129), as Ctrl-C exits 130, after the
  same clean-up: no temporary file left, no worker process left;
- a stderr that cannot be written changes no exit code;
- a usage error (click's: an unknown option, a missing argument, a bad choice) exits 2
  with its line and then click's ``Try 'sdpa check --help' for help.``; a bare group
  (``sdpa``, ``sdpa report``) prints its help on stdout and exits 0.

Result files (``--save``, ``--report``, ``--junit``, ``--export-*``) are written to
temporaries first and renamed into place only after stdout has been delivered and
flushed (:func:`~sdpa_cli.files.writers.staged`): a run whose stdout fails, or that is
interrupted, replaces no file. Devices and FIFOs named as outputs are written straight
into, before stdout.
"""

from __future__ import annotations

import contextvars
import importlib
import sys
import warnings
from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import click

from sdpa_cli._version import __version__
from sdpa_cli.cli import streams
from sdpa_cli.cli.completion import ACTIVATION_HELP
from sdpa_cli.errors import EXIT_CODES_HELP, ExitCode, SdpaError
from sdpa_cli.files.writers import staged

GLOSSARY_HELP = (
    "Every term sdpa prints (ulp, plain computation, LSE, headroom...) is defined in "
    "a few words in the documentation's Glossary (docs/reference/glossary.md)."
)


class SdpaGroup(click.Group):
    """A group whose errors are one line on stderr with the right exit code."""

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their short help, from :data:`COMMANDS`: no command's module
        is imported to list it (click's own listing would import all nine)."""
        if not isinstance(self.commands, LazyCommands):
            super().format_commands(ctx, formatter)
            return
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = [(n, click.Command(n, help=COMMANDS[n]).get_short_help_str(limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        # click answers a broken pipe with exit 1 ("check failed"): it is told apart here.
        # A command runs in a context of its own: the backend it chose (--backend) ends
        # with it, and does not reach the next command run in the same process.
        try:
            return contextvars.copy_context().run(super().invoke, ctx)
        except OSError as exc:
            raise streams.as_stream_error(exc) or exc from None

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        streams.set_up()
        # Overflow, NaN and inf are what the findings report, with where they happened;
        # numpy's RuntimeWarnings would say it again on stderr, without the where.
        warnings.simplefilter("ignore", RuntimeWarning)
        code: int
        try:
            streams.check_stdout()
            with staged() as outputs:
                result = super().main(
                    argv, prog_name or "sdpa", complete_var, standalone_mode=False, **extra
                )
                # Result files are renamed into place only once stdout is delivered.
                streams.decided(result if isinstance(result, int) else ExitCode.OK)
                streams.flush_stdout()
                outputs.commit()
            code = result if isinstance(result, int) else ExitCode.OK
        except SdpaError as exc:
            code = _fail(str(exc), ExitCode.BAD_INPUT)
        except streams.StdoutFailed as exc:
            _silence_stdout()
            code = _fail(str(exc), ExitCode.BAD_INPUT)
        except streams.PipeClosed:
            _silence_stdout()
            code = streams.verdict()  # the reader went away (| head): not an error
        except streams.Terminated as exc:
            code = _fail(f"interrupted ({exc.name})", 128 + exc.signum)
        except (click.exceptions.Abort, KeyboardInterrupt):
            code = _fail("interrupted", ExitCode.INTERRUPTED)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare sdpa, or a bare group
            click.echo(exc.format_message())
            code = ExitCode.OK
        except click.UsageError as exc:
            code = _fail(exc.format_message(), ExitCode.BAD_INPUT, _try_help(exc.ctx))
        except click.ClickException as exc:
            code = _fail(exc.format_message(), ExitCode.BAD_INPUT)
        except MemoryError:  # past the up-front check (which names the file): the machine's limit
            code = _fail(
                "out of memory: this run needs more than the machine, its ulimit -v or its "
                "container allows; slice the inputs or ask for fewer --stages",
                ExitCode.BAD_INPUT,
            )
        except Exception as exc:  # a bug: one line, the traceback only with --debug
            if "--debug" in argv:
                import traceback  # imported here: only a bug with --debug needs it

                traceback.print_exc()
            code = _fail(
                f"internal error: {type(exc).__name__}: {exc} "
                "(a bug in sdpa; please report it, with --debug for the traceback)",
                ExitCode.INTERNAL,
            )
        finally:
            streams.tear_down()
        if standalone_mode:
            sys.exit(int(code))
        return int(code)


def _silence_stdout() -> None:
    fd = streams.stream_fd(sys.stdout)
    if fd is not None:
        streams.silence(fd)


def _try_help(ctx: click.Context | None) -> str | None:
    """The line after a usage error, as click prints it: ``Try 'sdpa check --help' for help.``"""
    if ctx is None or ctx.command.get_help_option(ctx) is None:
        return None
    return f"Try '{ctx.command_path} --help' for help."


def _fail(message: str, code: int, then: str | None = None) -> int:
    """One line on stderr (and ``then``, a second); a stderr that cannot take it (a full
    disk) changes no code."""
    try:
        click.echo(f"sdpa: error: {message}", err=True)  # nothing when stderr is closed
        if then is not None:
            click.echo(then, err=True)
        if sys.stderr is not None:
            sys.stderr.flush()
    except OSError:
        fd = streams.stream_fd(sys.stderr)
        if fd is not None:
            streams.silence(fd)
    return code


@click.group(
    "sdpa",
    cls=SdpaGroup,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=f"{ACTIVATION_HELP}\n\n{GLOSSARY_HELP}\n\n{EXIT_CODES_HELP}",
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


COMMANDS = {
    "capture": "Run a Python program and record every attention call it makes, for sdpa check.",
    "check": "Validate exported attention tensors against a recomputed reference (for CI).",
    "completion": "Print the script that completes sdpa's commands, options and files in SHELL.",
    "compute": "Compute attention and show every stage: raw, scaled and masked scores, "
    "weights, output.",
    "diff": "Compare two runs of a model call by call, and name the first call that diverges.",
    "explain": "Walk one (batch, head) slice through every stage, saying what each did.",
    "grad": "Compute dQ, dK, dV (and d(bias)) of the loss Σ O ⊙ dO, and judge the "
    "gradients' health.",
    "inspect": "Show what tensor files hold: names, shapes, dtypes, min, max, mean, std, NaN "
    "and inf counts, and float16/bfloat16 headroom (overflow, flush to zero, subnormal).",
    "report": "Work with a manifest's runs: merge sharded reports, see a model at a glance.",
    "samples": "List the sample inputs shipped with sdpa, or copy them out.",
}
"""Each command (``sdpa_cli.cli.NAME``, the click command of that name) and the first
paragraph of its help, which ``sdpa --help`` lists without importing the command:
a command's module is imported only when it runs (tests/cli/test_cli.py holds the
two texts equal)."""


class LazyCommands(MutableMapping[str, click.Command]):
    """``cli.commands``: the commands of :data:`COMMANDS`, each module imported on
    first use, so that ``sdpa --help`` and ``sdpa compute`` import one command, not
    nine."""

    def __init__(self) -> None:
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            if name not in COMMANDS:
                raise KeyError(name)
            module = importlib.import_module(f"sdpa_cli.cli.{name}")
            self._loaded[name] = getattr(module, name)
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted({*COMMANDS, *self._loaded}))

    def __len__(self) -> int:
        return len({*COMMANDS, *self._loaded})


cli.commands = LazyCommands()


def main(args: Sequence[str] | None = None, prog_name: str = "sdpa") -> None:
    """The console-script entry point."""
    cli.main(args=args, prog_name=prog_name)
