"""Run a Python program in this process, as ``python -m runpy`` would, for ``sdpa
capture -- python script.py ARGS`` (or ``-- script.py ARGS``, ``-- -m module ARGS``).

The program sees the ``sys.argv`` and ``sys.path[0]`` the interpreter would give it
(the script's folder; the working directory under ``-m``), runs as ``__main__``, and its
exit status comes back as the interpreter would make it: ``sys.exit(n)`` is n, ``None``
0, a message 1 (printed on stderr), an uncaught exception 1 (its traceback printed on
stderr by ``sys.excepthook``, from the program's first frame). Both are what the
program itself prints, as under ``python``. An error of sdpa's own (the capture's
writes) and Ctrl-C are raised, for the command line to report.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sdpa_cli.errors import SdpaError, SpecError
from sdpa_cli.text import printable

_PYTHON = re.compile(r"python[0-9.]*(\.exe)?", re.IGNORECASE)


@dataclass(frozen=True)
class Program:
    """What to run: a script's path or a module's name (``module`` true), and its arguments."""

    target: str
    args: tuple[str, ...]
    module: bool = False

    @classmethod
    def parse(cls, argv: Sequence[str]) -> Program:
        """``[python] script.py ARGS`` or ``[python] -m module ARGS``.

        Raises:
            SpecError: nothing to run, an interpreter option other than ``-m``, or no
                such script.
        """
        words = list(argv)
        if words and _PYTHON.fullmatch(Path(words[0]).name):
            words = words[1:]
        if not words:
            raise SpecError(
                "capture", "give the program to run: -- python script.py ARGS or -- -m module ARGS"
            )
        if words[0] == "-m":
            if len(words) < 2:
                raise SpecError("-m", "expected a module name after it")
            return cls(words[1], tuple(words[2:]), module=True)
        if words[0].startswith("-"):
            raise SpecError(
                printable(words[0]),
                "is an interpreter option capture does not take; give script.py ARGS or -m module ARGS",
            )
        path = Path(words[0])
        if not path.is_file():
            problem = (
                "is a directory; expected a Python script" if path.is_dir() else "no such script"
            )
            raise SpecError(printable(words[0]), problem)
        return cls(words[0], tuple(words[1:]))


def run_program(program: Program) -> int:
    """Run ``program`` as ``__main__``; its exit status.

    Raises:
        SpecError: ``-m`` names a module that cannot be found.
    """
    saved_argv, saved_path = sys.argv, sys.path[:]
    sys.argv = [program.target, *program.args]  # under -m, runpy puts the module's file first
    folder = os.getcwd() if program.module else str(Path(program.target).resolve().parent)
    sys.path[0:1] = [folder]
    try:
        if program.module:
            _find_module(program.target)
            runpy.run_module(program.target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(program.target, run_name="__main__")
    except SystemExit as done:
        return _exit_status(done.code)
    except (SdpaError, KeyboardInterrupt):
        raise
    except Exception as exc:
        _report(exc)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _find_module(name: str) -> None:
    """Refuse a module that cannot be found, before anything runs."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise SpecError("-m", f"no module named {printable(name)!r}")


def _exit_status(code: object) -> int:
    """The process status of ``sys.exit(code)``, as the interpreter makes it."""
    if code is None:
        return 0
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    print(code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    return 1


def _report(exc: BaseException) -> None:
    """The program's uncaught exception, as the interpreter reports it: through
    ``sys.excepthook``, the traceback starting at the program's own first frame."""
    tb = exc.__traceback__
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)
