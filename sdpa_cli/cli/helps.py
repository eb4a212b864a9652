"""Help that fits a screen: each command's ``--help`` shows what it does, a few
examples that run anywhere (``sample:NAME``), and the options a user needs first in
named groups; ``--help-all`` shows everything, as the reference pages do.

The groups are data (:data:`COMMON`), one place a command's first options are chosen;
a test holds every command's default help to :data:`MOST_LINES` at 80 columns and runs
every example it shows in an empty folder.
"""

from __future__ import annotations

import inspect
from typing import Any

import click

MOST_LINES = 60
"""A default help's most lines at 80 columns."""

SHOWN_EXAMPLES = 3
"""The examples a default help shows (the rest: ``--help-all``)."""

HELP_ALL = "sdpa.help_all"
"""The context's key saying that ``--help-all`` asked for every option."""

INPUTS = "Inputs"
ATTENTION = "The attention computed"
JUDGEMENT = "The judgement"
OUTPUTS = "Outputs"

_ATTENTION = ("causal", "mask_path", "scale", "window", "key_lengths", "dtype")

COMMON: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "compute": (
        (ATTENTION, _ATTENTION),
        (OUTPUTS, ("stages", "batch", "head", "rows", "fmt", "page", "save")),
    ),
    "explain": (
        (ATTENTION, _ATTENTION),
        (OUTPUTS, ("head", "rows", "query", "backward", "fmt", "page")),
    ),
    "check": (
        (INPUTS, ("expect_output", "expect_weights", "expect_lse", "manifest")),
        (ATTENTION, _ATTENTION),
        (JUDGEMENT, ("tolerance", "rtol", "atol")),
        (OUTPUTS, ("fmt", "report", "junit", "page")),
    ),
    "grad": (
        (INPUTS, ("dout",)),
        (ATTENTION, _ATTENTION),
        (JUDGEMENT, ("check_numeric", "vanishing")),
        (OUTPUTS, ("head", "rows", "fmt", "save")),
    ),
    "model": ((OUTPUTS, ("metric", "fmt", "page", "tokens")),),
}
"""Per command (by its name), its first options in named groups, in order; a command
not listed shows every option (it has few)."""


def _help_all(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    ctx.meta[HELP_ALL] = True
    click.echo(ctx.get_help(), color=ctx.color)
    ctx.exit()


class SdpaCommand(click.Command):
    """A command whose ``--help`` fits a screen (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.name in COMMON:
            self.params.append(
                click.Option(
                    ["--help-all"],
                    is_flag=True,
                    expose_value=False,
                    is_eager=True,
                    callback=_help_all,
                    help="Show every option and example, and exit.",
                )
            )

    def _short(self, ctx: click.Context) -> bool:
        return self.name in COMMON and not ctx.meta.get(HELP_ALL, False)

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The first paragraph and the first examples, unless ``--help-all``."""
        if not self._short(ctx) or not self.help:
            super().format_help_text(ctx, formatter)
            return
        text = short_help_text(self.help)
        formatter.write_paragraph()
        with formatter.indentation():
            formatter.write_text(text)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The common options in their groups (``--help-all``: then every other one)."""
        groups = COMMON.get(self.name or "")
        if groups is None:
            super().format_options(ctx, formatter)
            return
        records = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx)}
        shown: set[str | None] = set()
        for title, names in groups:
            rows = [records[n] for n in names if records.get(n) is not None]
            shown.update(names)
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)  # type: ignore[arg-type]
        if not self._short(ctx):
            rest = [r for n, r in records.items() if n not in shown and r is not None]
            with formatter.section("Every other option"):
                formatter.write_dl(rest)
            return
        hidden = [n for n in records if n not in shown and n not in ("help", "help_all")]
        formatter.write_paragraph()
        formatter.write_text(f"{len(hidden)} more options: {ctx.command_path} --help-all")


SHORT_PARAGRAPH = 240
"""A second paragraph this short (three lines at 80 columns: compute's input formats)
stays in the default help."""


def short_help_text(text: str) -> str:
    """A docstring's first paragraph (and its second, when short), then its examples
    block cut to :data:`SHOWN_EXAMPLES` (``\\b`` kept, so that click does not rewrap it)."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    out = [paragraphs[0]]
    second = paragraphs[1] if len(paragraphs) > 1 else ""
    if second and "\b" not in second and len(second) <= SHORT_PARAGRAPH:
        out.append(second)
    for p in paragraphs[1:]:
        lines = p.strip().splitlines()
        if lines and lines[0].strip() == "\b" and len(lines) > 1 and "Example" in lines[1]:
            out.append("\n".join(lines[: 2 + SHOWN_EXAMPLES]))
    return "\n\n".join(out)
