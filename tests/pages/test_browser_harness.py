"""The browser harness itself, on small pages: it sees console errors, uncaught exceptions
and outside requests (and aborts them), clicks, reads the DOM and takes screenshots."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pages.browser import chromium_path, open_page

if TYPE_CHECKING:
    from playwright.sync_api import Browser

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_page(folder: Path, body: str) -> Path:
    """A self-contained page around ``body``, written to ``folder``."""
    path = folder / "page.html"
    path.write_text(
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><title>t</title>'
        f"</head>\n<body>\n{body}\n</body></html>\n",
        encoding="utf-8",
    )
    return path


def test_a_clean_page_is_clean(browser: Browser, tmp_path: Path) -> None:
    page = write_page(
        tmp_path, '<p id="p">hello</p><img src="data:image/gif;base64,R0lGODlhAQABAAAAACw=">'
    )
    with open_page(browser, page) as visit:
        visit.assert_clean()
        assert visit.page.text_content("#p") == "hello"


def test_a_console_error_is_caught(browser: Browser, tmp_path: Path) -> None:
    page = write_page(tmp_path, '<script>console.error("x")</script>')
    with open_page(browser, page) as visit:
        assert visit.console_errors == [f"error: x ({page.as_uri()}:4)"]
        with pytest.raises(AssertionError, match=r"is not clean:\n  console error: x"):
            visit.assert_clean()


def test_a_console_warning_and_an_uncaught_exception_are_caught(
    browser: Browser, tmp_path: Path
) -> None:
    page = write_page(tmp_path, '<script>console.warn("w"); null.f()</script>')
    with open_page(browser, page) as visit:
        assert visit.console_errors[0].startswith("warning: w")
        assert visit.console_errors[1].startswith(
            "uncaught: TypeError: Cannot read properties of null (reading 'f')"
        )
        assert len(visit.console_errors) == 2


def test_an_outside_request_is_recorded_and_aborted(browser: Browser, tmp_path: Path) -> None:
    page = write_page(tmp_path, '<img id="i" src="https://example.com/a.png">')
    with open_page(browser, page) as visit:
        assert visit.requests == ["https://example.com/a.png"]
        # Aborted: the image never loaded, and the browser said so in the console.
        assert visit.page.eval_on_selector("#i", "img => img.naturalWidth") == 0
        assert any("net::ERR_FAILED" in line for line in visit.console_errors)
        with pytest.raises(AssertionError, match=r"request https://example\.com/a\.png"):
            visit.assert_clean()


def test_fetches_sockets_and_sibling_files_are_outside_requests(
    browser: Browser, tmp_path: Path
) -> None:
    (tmp_path / "other.css").write_text("p { color: red }", encoding="utf-8")
    page = write_page(
        tmp_path,
        '<link rel="stylesheet" href="other.css">\n'
        "<script>window.done = 0;\n"
        'fetch("http://127.0.0.1:9/q").catch(() => { window.done += 1; });\n'
        'new WebSocket("wss://example.com/s").onclose = () => { window.done += 1; };</script>',
    )
    with open_page(browser, page) as visit:
        # Both fail once the harness has answered them, after load.
        visit.page.wait_for_function("() => window.done === 2")
        assert sorted(visit.requests) == sorted(
            [(tmp_path / "other.css").as_uri(), "http://127.0.0.1:9/q", "wss://example.com/s"]
        )


def test_a_click_changes_the_dom(browser: Browser, tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        '<button id="b">go</button><div id="d">before</div>\n'
        "<script>document.getElementById('b').addEventListener('click', () => {"
        " document.getElementById('d').textContent = 'after'; });</script>",
    )
    with open_page(browser, page) as visit:
        assert visit.page.text_content("#d") == "before"
        visit.page.click("#b")
        assert visit.page.text_content("#d") == "after"
        visit.assert_clean()


def test_a_screenshot_is_the_full_page(browser: Browser, tmp_path: Path) -> None:
    page = write_page(tmp_path, '<div style="height: 2000px; background: #36c">tall</div>')
    with open_page(browser, page, width=400, height=300) as visit:
        shot = visit.screenshot(tmp_path / "shot.png")
    data = shot.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    # The IHDR chunk: width and height, big-endian, after the signature and its header.
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width == 400
    assert height > 2000


def test_no_chromium_when_the_variable_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDPA_CHROMIUM", "")
    assert chromium_path() is None
    monkeypatch.setenv("SDPA_CHROMIUM", "/opt/chromium/chrome")
    assert chromium_path() == "/opt/chromium/chrome"
