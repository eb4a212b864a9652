"""Shell completion: what a file argument, a format or a comma list completes to, and
``sdpa completion SHELL``, the script a shell sources to complete ``sdpa``.

Completion is click's protocol: the shell runs ``sdpa`` with ``_SDPA_COMPLETE`` set
(``bash_complete``, ``zsh_complete``, ``fish_complete``), and click answers from each
parameter's ``shell_complete``. A file completes as the shell completes paths (the item
of type ``file``); an option that takes a free value the engine checks (``--dtype``,
``--scale``) offers its usual words; a comma list (``--stages``, ``--fail-on``) offers
the words not yet given after the last comma.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import click
from click.shell_completion import CompletionItem, get_completion_class

from sdpa_cli.names import KINDS, STAGES

Complete = Callable[[click.Context, click.Parameter, str], list[CompletionItem]]
"""A parameter's ``shell_complete``."""

SHELLS = ("bash", "zsh", "fish")
COMPLETE_VAR = "_SDPA_COMPLETE"

ACTIVATION_HELP = (
    "\b\n"
    "Shell completion (commands, options, their choices, files):\n"
    '  eval "$(sdpa completion bash)"    # in ~/.bashrc\n'
    '  eval "$(sdpa completion zsh)"     # in ~/.zshrc\n'
    "  sdpa completion fish > ~/.config/fish/completions/sdpa.fish"
)
"""The lines of ``sdpa --help`` that say how to turn completion on."""


def files(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """A path, completed by the shell."""
    return [CompletionItem(incomplete, type="file")]


def directories(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """A folder, completed by the shell."""
    return [CompletionItem(incomplete, type="dir")]


def words(*choices: str, paths: bool = False) -> Complete:
    """The ``choices`` that start with what was typed (and, with ``paths``, a path)."""

    def complete(
        ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        found = [CompletionItem(c) for c in choices if c.startswith(incomplete)]
        return found + files(ctx, param, incomplete) if paths else found

    return complete


def word_list(choices: Callable[[], Sequence[str]]) -> Complete:
    """A comma-separated list of ``choices()``: the words not given yet that start with
    what was typed after the last comma, each after the words before it."""

    def complete(
        ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        given, comma, last = incomplete.rpartition(",")
        before = given + comma
        taken = set(given.split(","))
        return [
            CompletionItem(before + c) for c in choices() if c.startswith(last) and c not in taken
        ]

    return complete


def stage_names() -> Sequence[str]:
    """The forward stages, as ``--stages`` names them."""
    return STAGES


def finding_kinds() -> Sequence[str]:
    """The finding kinds ``--fail-on`` gates, and ``none``."""
    return (*KINDS, "none")


@click.command()
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the script that completes sdpa's commands, options and files in SHELL.

    \b
    Examples:
      eval "$(sdpa completion bash)"     # in ~/.bashrc
      eval "$(sdpa completion zsh)"      # in ~/.zshrc
      sdpa completion fish > ~/.config/fish/completions/sdpa.fish
    """
    root = ctx.find_root()
    script = get_completion_class(shell)
    assert script is not None  # every name in SHELLS is one of click's
    click.echo(script(root.command, {}, root.info_name or "sdpa", COMPLETE_VAR).source())
