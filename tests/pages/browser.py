"""The report pages opened in a real headless browser: the console, the network, the DOM.

A page is judged in a browser as terminal output is judged in a terminal. :func:`open_page`
opens a page from disk in Debian's ``chromium`` (driven by Playwright's client, which never
downloads a browser of its own here), records what a user's console would show and every
request that leaves the page, and hands back the live page for clicks, DOM reads and
screenshots. The pages are self-contained: a request for anything but the page itself (or a
``data:`` or ``blob:`` URL) is recorded and aborted, so no test ever touches the network.

The ``browser`` fixture (``conftest.py`` beside this module) launches the browser once per
session and skips, saying why, where Playwright or a chromium is missing.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # Playwright is a dev dependency: at run time this module imports without it, so that
    # the fixture can skip with a reason rather than the collection failing.
    from playwright.sync_api import (
        Browser,
        BrowserContext,
        ConsoleMessage,
        Page,
        Route,
        WebSocketRoute,
    )
    from playwright.sync_api import Error as PlaywrightError

# SDPA_CHROMIUM names the browser binary; set and empty, it means "no browser" (the tests
# skip), which is how the skip itself is tested.
CHROMIUM_ENV = "SDPA_CHROMIUM"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# As root, chromium refuses to start without --no-sandbox; there is no GPU to use headless.
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu")
# Console message types recorded as problems.
PROBLEM_TYPES = ("error", "warning")
# URL schemes that never leave the page.
INLINE_SCHEMES = ("data:", "blob:")
# Milliseconds a page action (load, click, a wait) may take before the test fails: a local
# page that needs more is broken, and a short wait fails fast.
ACTION_TIMEOUT_MS = 10_000


def chromium_path() -> str | None:
    """The chromium binary to drive, or None where there is none.

    ``SDPA_CHROMIUM`` wins when set (empty: none); otherwise the first of
    :data:`CHROMIUM_NAMES` on ``PATH``.
    """
    if CHROMIUM_ENV in os.environ:
        return os.environ[CHROMIUM_ENV] or None
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class Visit:
    """An open page and what it did on its way to loaded, and after.

    Attributes:
        page: The live Playwright page: click it, read its DOM.
        context: Its browser context, the page's alone; :meth:`close` closes it.
        console_errors: Console errors and warnings (``"error: text (where)"``) and uncaught
            exceptions (``"uncaught: TypeError: ..."``), in the order they came.
        requests: Every URL the page asked for that is not the page itself or inline
            (``data:``, ``blob:``); each was aborted. WebSocket URLs too.
    """

    page: Page
    context: BrowserContext
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def assert_clean(self) -> None:
        """Assert that the page wrote no error or warning and asked for nothing outside."""
        problems = [f"console {line}" for line in self.console_errors]
        problems += [f"request {url}" for url in self.requests]
        assert not problems, f"{self.page.url} is not clean:\n  " + "\n  ".join(problems)

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the whole page (beyond the viewport) to ``path``; return ``path``."""
        self.page.screenshot(path=path, full_page=True)
        return path

    def close(self) -> None:
        """Close the page's context (and the page)."""
        self.context.close()

    def __enter__(self) -> Visit:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def open_page(browser: Browser, path: Path, width: int = 1280, height: int = 900) -> Visit:
    """Open the page at ``path`` in a fresh context of a ``width`` × ``height`` viewport.

    Returns once the page has fired ``load``, its console and its requests recorded from
    the first byte on (and still recorded while the :class:`Visit` is open). Close the
    visit (or use it as a context manager) to free its context.
    """
    own_url = path.resolve().as_uri()
    # offline: a second guard behind the route below (navigator.onLine is then false).
    context = browser.new_context(
        viewport={"width": width, "height": height}, offline=True, service_workers="block"
    )
    context.set_default_timeout(ACTION_TIMEOUT_MS)
    page = context.new_page()
    visit = Visit(page=page, context=context)

    def on_request(route: Route) -> None:
        url = route.request.url
        if url == own_url or url.startswith(INLINE_SCHEMES):
            route.continue_()
        else:
            visit.requests.append(url)
            route.abort()

    def on_web_socket(socket: WebSocketRoute) -> None:
        # Not connected to any server: the page sees the socket close.
        visit.requests.append(socket.url)
        socket.close()

    def on_console(message: ConsoleMessage) -> None:
        if message.type in PROBLEM_TYPES:
            visit.console_errors.append(f"{message.type}: {message.text} ({_where(message)})")

    def on_page_error(error: PlaywrightError) -> None:
        # The stack's first two lines: "TypeError: message" and where it was thrown.
        head = (error.stack or error.message).splitlines()[:2]
        visit.console_errors.append("uncaught: " + " ".join(line.strip() for line in head))

    context.route("**/*", on_request)
    context.route_web_socket("**/*", on_web_socket)
    page.on("console", on_console)
    page.on("pageerror", on_page_error)
    try:
        page.goto(own_url, wait_until="load")
    except BaseException:
        context.close()
        raise
    return visit


def _where(message: ConsoleMessage) -> str:
    """Where a console message came from: a URL, with its line when it is a script's."""
    location = message.location
    url = location["url"]
    if not url:
        return "no location"
    # Playwright's line numbers count from 0; a resource's messages carry line 0 and no
    # column, and name the resource that failed.
    if location["lineNumber"] == 0 and location["columnNumber"] == 0:
        return url
    return f"{url}:{location['lineNumber'] + 1}"
