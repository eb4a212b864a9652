"""The headless browser the page tests share, launched once per session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from pages.browser import CHROMIUM_ARGS, CHROMIUM_ENV, CHROMIUM_NAMES, chromium_path

if TYPE_CHECKING:
    from playwright.sync_api import Browser


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """Debian's chromium, headless, driven through Playwright's sync API.

    Skips, saying why, where Playwright is not importable, no chromium is found (``make
    test`` installs one as root where apt-get is available) or it fails to start.
    """
    try:
        # Here, not at the top: without the dev extra, the page tests skip rather than the
        # collection failing.
        from playwright.sync_api import Error, sync_playwright
    except ImportError as error:
        pytest.skip(f"playwright not importable ({error}): the browser tests are skipped")
    executable = chromium_path()
    if executable is None:
        pytest.skip(
            f"no chromium ({CHROMIUM_ENV} empty, or none of {', '.join(CHROMIUM_NAMES)} on "
            "PATH): the browser tests are skipped"
        )
    try:
        playwright = sync_playwright().start()
    except (Error, OSError) as error:  # OSError: its bundled node would not run
        pytest.skip(f"playwright's driver did not start: {_summary(error)}")
    try:
        try:
            launched = playwright.chromium.launch(
                executable_path=executable, headless=True, args=list(CHROMIUM_ARGS)
            )
        except Error as error:
            pytest.skip(f"chromium at {executable} did not start: {_summary(error)}")
        yield launched
        launched.close()
    finally:
        playwright.stop()


def _summary(error: Exception) -> str:
    """An error's first line and the browser's own last line (a crash's reason), where it
    wrote one: Playwright's launch errors run to a page of log, mostly the command line."""
    lines = [line.strip() for line in str(error).strip().splitlines()]
    if not lines:
        return type(error).__name__
    browser_said = []
    if "Browser logs:" in lines:
        logs = lines[lines.index("Browser logs:") + 1 :]
        logs = logs[: logs.index("Call log:")] if "Call log:" in logs else logs
        browser_said = [line for line in logs if line and not line.startswith("<")]
    return "; ".join([lines[0], *browser_said[-1:]])
