"""One exception tree and the exit codes.

Every error the library raises on purpose is an :class:`SdpaError`. Each carries
``where`` (the file or option at fault) and ``problem`` (what is wrong with it), so
the command line can print the single line ``sdpa: error: <where>: <problem>``.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """The process exit statuses, the same for every command."""

    OK = 0
    """Success (``compute`` and ``explain`` exit 0 whatever they find)."""
    CHECK_FAILED = 1
    """``check`` ran and a check failed."""
    BAD_INPUT = 2
    """Bad usage, or an unreadable or invalid input. Never 1."""
    INTERNAL = 3
    """A bug in sdpa: the message asks for a report."""
    INTERRUPTED = 130
    """Ctrl-C."""


EXIT_CODES_HELP = (  # the epilog of every command's --help
    "Exit codes: 0 success (a reader of stdout that leaves early, as | head, is no failure) · "
    "1 a check failed (sdpa check, sdpa grad --check-numeric) or a run diverged (sdpa diff) · "
    "2 bad usage, bad input, or an output (stdout included) that cannot be written · "
    "3 internal error (please report) · "
    "130 interrupted (Ctrl-C) · 143 SIGTERM · 129 SIGHUP."
)


MAX_WHERE = 200
"""A file name longer than this is shortened in the middle in messages."""


def shortened(where: str, limit: int = MAX_WHERE) -> str:
    """``where`` cut in the middle with ``…`` to ``limit`` characters: the start and
    the end of a path say which file it is; a 6,000-character path would fill a screen."""
    if len(where) <= limit:
        return where
    keep = limit - 1
    return where[: keep - keep // 2] + "…" + where[len(where) - keep // 2 :]


class SdpaError(Exception):
    """Base of every error sdpa raises on purpose.

    Args:
        where: the file (as given) or option (``--window``) at fault; empty if none;
            shortened in the middle past :data:`MAX_WHERE` characters.
        problem: what is wrong, in one line, saying what was expected and what came.
    """

    def __init__(self, where: str, problem: str) -> None:
        where = shortened(where)
        super().__init__(f"{where}: {problem}" if where else problem)
        self.where = where
        self.problem = problem


class InputError(SdpaError):
    """A file that cannot be read, or whose content is not what it should be."""


class SpecError(SdpaError):
    """Inputs or options that do not fit together: shapes, masks, option values."""
