"""The report pages as a person meets them: each made by the installed ``sdpa`` in a
temporary folder, opened from disk in headless chromium, clicked, pointed at and read.

Every page must open clean (no console error or warning, no request leaving it), draw
every picture, and stay a reasonable size. With ``SDPA_SCREENSHOTS=1`` the tests also
save what a person sees, the whole page 1280 px wide, to ``docs/images/page-*.png``;
otherwise they write nothing into the repository.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from clirunner import clean_environ, sdpa_executable

from pages.browser import Visit, open_page

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

# Every test here runs the sdpa entry point in a subprocess.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "samples"
SCREENSHOTS_ENV = "SDPA_SCREENSHOTS"
SCREENSHOTS = ROOT / "docs" / "images"
KB = 1024

# The sample model is three attention calls of 8 positions; one token labels each.
TOKENS = ["The", "cat", "sat", "on", "the", "mat", "today", "."]
SINK = '[data-case="1"][data-head="0"]'
DEAD = '[data-case="1"][data-head="2"]'
SATURATED = '[data-case="2"][data-head="3"]'
PLAIN = '[data-case="0"][data-head="0"]'
PATTERN = "#pattern figure.heat"

# The failing export: float16 inputs of (B, H, L, E) = (1, 4, 256, 64), causal.
SHAPE = (1, 4, 256, 64)
L = SHAPE[2]

ASKED_FOR_ONLY = "only the computation asked for sees it"
EXPORT_ONLY = "only the computation the export matches sees it"

# The colour (r, g, b) of a picture's pixel at fractions (x, y) of its width and height,
# read back by drawing the picture on a canvas at its natural size.
PIXEL_AT = """(img, [x, y]) => {
  const canvas = document.createElement('canvas');
  canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
  const context = canvas.getContext('2d');
  context.drawImage(img, 0, 0);
  const at = context.getImageData(Math.floor(x * canvas.width), Math.floor(y * canvas.height), 1, 1);
  return Array.from(at.data.slice(0, 3));
}"""


def sdpa(folder: Path, *args: str, exit_code: int = 0) -> None:
    """Run ``sdpa ARGS`` in ``folder`` as a user would, expecting ``exit_code``."""
    proc = subprocess.run(
        [sdpa_executable(), *args],
        cwd=folder,
        capture_output=True,
        text=True,
        env=clean_environ(COLUMNS="100"),
        timeout=120,
    )
    assert proc.returncode == exit_code, (proc.returncode, proc.stderr)


def sink_mass(page: Path, case: int, head: int) -> float:
    """A head's sink mass as ``sdpa report model --format json`` gives it, for the
    manifest the page beside it was made from."""
    proc = subprocess.run(
        [sdpa_executable(), "report", "model", "model/manifest.yaml", "--format", "json"],
        cwd=page.parent,
        capture_output=True,
        text=True,
        env=clean_environ(),
        timeout=120,
        check=True,
    )
    return float(json.loads(proc.stdout)["metrics"]["sink_mass"][case][head])


def assert_size(page: Path, most_kb: int) -> None:
    """The page file exists and is under ``most_kb`` KB (a loose bound: a page that
    grows past it carries something it should not)."""
    size = page.stat().st_size
    assert 0 < size < most_kb * KB, f"{page.name} is {size / KB:.0f} KB, over {most_kb} KB"


def assert_pictures_drawn(page: Page) -> None:
    """Every heat map's picture decoded: none is a broken image."""
    widths = page.eval_on_selector_all(
        "figure.heat img", "imgs => imgs.map(img => [img.closest('figure').id, img.naturalWidth])"
    )
    assert [name for name, width in widths if width == 0] == []


def point_at(page: Page, figure: str, x: float, y: float) -> str:
    """Move the pointer over the picture of ``figure`` (a selector) at fractions ``x``,
    ``y`` of its width and height; return what the figure's read-out then says."""
    picture = page.locator(f"{figure} img")
    picture.scroll_into_view_if_needed()
    box = picture.bounding_box()
    assert box is not None, f"{figure}'s picture is not shown"
    page.mouse.move(box["x"] + x * box["width"], box["y"] + y * box["height"])
    return page.locator(f"{figure} output.readout").inner_text()


def background(page: Page, cell: str) -> str:
    """The colour a grid cell is painted, as the browser computes it."""
    colour: str = page.eval_on_selector(
        f"td.cell{cell}", "td => getComputedStyle(td).backgroundColor"
    )
    return colour


def keep_screenshot(visit: Visit, name: str) -> None:
    """With ``SDPA_SCREENSHOTS=1``: the whole page as it is now, 1280 px wide, saved to
    ``docs/images/page-NAME.png`` for the documentation and a person's review.
    Otherwise nothing: a test run writes nothing into the repository."""
    if os.environ.get(SCREENSHOTS_ENV) == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        visit.screenshot(SCREENSHOTS / f"page-{name}.png")


# --- sdpa report model --html: the layer × head grid ------------------------------------


@pytest.fixture(scope="module")
def model_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``sdpa report model model/manifest.yaml --html model.html --tokens tokens.txt``
    over a copy of the sample model, its positions labelled with :data:`TOKENS`."""
    folder = tmp_path_factory.mktemp("model")
    shutil.copytree(SAMPLES / "model", folder / "model")
    (folder / "tokens.txt").write_text("\n".join(TOKENS) + "\n", encoding="utf-8")
    sdpa(
        folder,
        *("report", "model", "model/manifest.yaml"),
        *("--html", "model.html", "--tokens", "tokens.txt"),
    )
    page = folder / "model.html"
    assert_size(page, most_kb=500)
    return page


def test_the_model_page_marks_the_planted_heads(browser: Browser, model_page: Path) -> None:
    """A person sees a grid of 3 layers × 4 heads, nothing broken: the attention sink
    (layer 1 head 0), the dead head (layer 1 head 2) and the saturated head (layer 2
    head 3) that the sample plants are framed and marked; an ordinary head is not."""
    with open_page(browser, model_page) as visit:
        page = visit.page
        visit.assert_clean()
        assert_pictures_drawn(page)
        assert page.locator("#grid td.cell").count() == 3 * 4
        for head in (SINK, DEAD, SATURATED):
            assert "notable" in (page.get_attribute(f"td.cell{head}", "class") or "")
            assert page.locator(f"td.cell{head} .mark").count() == 1
        assert "notable" not in (page.get_attribute(f"td.cell{PLAIN}", "class") or "")


def test_choosing_the_sink_shows_its_pattern(browser: Browser, model_page: Path) -> None:
    """Clicking an ordinary head says "Nothing notable."; clicking the sink says it is an
    attention sink and draws its pattern, its axes labelled with the tokens; pointing at
    the last query's weight on the first key reads that weight, large, by token."""
    with open_page(browser, model_page) as visit:
        page = visit.page
        page.click(f"td.cell{PLAIN}")
        assert page.inner_text("#pattern .found") == "Nothing notable."

        page.click(f"td.cell{SINK}")
        assert page.inner_text("#pattern h3") == "model.layers.1.self_attn, head 0"
        assert "attention sink" in page.inner_text("#pattern p.found")
        # the sink mass the page says is the one the grid's JSON holds for that head
        said = re.search(r"sink mass: ([0-9.]+)", page.inner_text("#pattern p.facts"))
        assert said is not None
        assert float(said[1]) == pytest.approx(sink_mass(model_page, 1, 0), abs=0.005)
        assert page.eval_on_selector(f"{PATTERN} img", "img => img.naturalWidth") > 0
        assert page.get_attribute(PATTERN, "data-rows") == str(len(TOKENS))
        assert json.loads(page.get_attribute(PATTERN, "data-xnames") or "null") == TOKENS
        assert json.loads(page.get_attribute(PATTERN, "data-ynames") or "null") == TOKENS

        # The centre of the cell of query 7 (".") and key 0 ("The"), of 8 × 8.
        readout = point_at(page, PATTERN, 0.5 / 8, 7.5 / 8)
        # (≈: a model page reads its patterns' values back from the pictures.)
        found = re.fullmatch(r'query 7 "\.", key 0 "The": (?:≈ )?([0-9.]+) weight', readout)
        assert found, readout
        assert float(found[1]) > 0.5  # a sink: most of the row's weight on key 0
        keep_screenshot(visit, "model")
        visit.assert_clean()


def test_choosing_a_measure_recolours_the_grid(browser: Browser, model_page: Path) -> None:
    """Choosing "sink mass" in the Colour-by list repaints the cells and says what the
    colour now means."""
    with open_page(browser, model_page) as visit:
        page = visit.page
        before = background(page, PLAIN)
        page.select_option("#measure", "sink_mass")
        assert background(page, PLAIN) != before
        assert "key 0" in page.inner_text("#measure-about")
        visit.assert_clean()


def test_a_captures_tokens_label_the_pattern(browser: Browser, tmp_path: Path) -> None:
    """Without --tokens, the capture's tokens.json beside the manifest labels the axes."""
    shutil.copytree(SAMPLES / "model", tmp_path / "model")
    (tmp_path / "model" / "tokens.json").write_text(json.dumps(TOKENS), encoding="utf-8")
    sdpa(tmp_path, "report", "model", "model/manifest.yaml", "--html", "model.html")
    with open_page(browser, tmp_path / "model.html") as visit:
        visit.page.click(f"td.cell{DEAD}")
        assert json.loads(visit.page.get_attribute(PATTERN, "data-xnames") or "null") == TOKENS
        visit.assert_clean()


# --- sdpa check --html: where a failing export's error sits -----------------------------


@pytest.fixture(scope="module")
def check_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random float16 q, k, v of :data:`SHAPE` (seed 0) and two exports of causal
    attention over them, computed by PyTorch's SDPA in float32 and cast to float16:
    ``good.npy`` with the causal mask, ``flipped.npy`` from a kernel that built it with
    torch.triu instead of tril (each query sees itself and the keys after it)."""
    torch = pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("check")
    rng = np.random.default_rng(0)
    arrays = {name: rng.standard_normal(SHAPE).astype(np.float16) for name in "qkv"}
    for name, array in arrays.items():
        np.save(folder / f"{name}.npy", array)
    q, k, v = (torch.from_numpy(arrays[name].astype(np.float32)) for name in "qkv")
    attend = torch.nn.functional.scaled_dot_product_attention
    flipped_mask = torch.ones(L, L, dtype=torch.bool).triu()
    exports = {
        "good": attend(q, k, v, is_causal=True),
        "flipped": attend(q, k, v, attn_mask=flipped_mask),
    }
    for name, out in exports.items():
        np.save(folder / f"{name}.npy", out.numpy().astype(np.float16))
    return folder


def test_a_flipped_causal_mask_draws_the_two_triangles(
    browser: Browser, check_folder: Path
) -> None:
    """The failing check's page names the failed checks, maps where the output's error
    sits, and draws the two masks: every (query, key) pair off the diagonal differs, the
    causal mask asked for seeing the pairs below it (one colour) and the flipped mask the
    export matches seeing those above it (another colour)."""
    sdpa(
        check_folder,
        *("check", "q.npy", "k.npy", "v.npy", "--causal"),
        *("--expect-output", "flipped.npy", "--html", "flipped.html"),
        exit_code=1,
    )
    page_file = check_folder / "flipped.html"
    assert_size(page_file, most_kb=1024)
    with open_page(browser, page_file) as visit:
        page = visit.page
        visit.assert_clean()
        assert_pictures_drawn(page)
        assert "checks failed" in page.inner_text("header .fail")
        assert "output.close" in page.inner_text("header .fail")
        assert page.locator("table.lines td.fail").count() >= 1
        for figure in ("#output-rows", "#output-worst", "#output-mask"):
            assert page.locator(f"figure.heat{figure}").count() == 1, figure

        differ = L * (L - 1)  # all but the diagonal
        caption = page.inner_text("#output-mask figcaption")
        assert re.search(rf"\b{differ:,} \(query, key\) pairs differ", caption), caption
        assert f"{differ} query-key pairs" in (page.get_attribute("#output-mask img", "alt") or "")

        # The legend beside the masks: a colour for each kind of pair.
        legend = page.eval_on_selector_all(
            "#output-mask .legend .swatch",
            "swatches => Object.fromEntries(swatches.map(s =>"
            " [getComputedStyle(s).backgroundColor, s.nextSibling.textContent.trim()]))",
        )
        below = page.eval_on_selector("#output-mask img", PIXEL_AT, [0.25, 0.75])
        above = page.eval_on_selector("#output-mask img", PIXEL_AT, [0.75, 0.25])
        white = [255, 255, 255]
        assert below != white
        assert above != white
        assert below != above
        assert legend["rgb({}, {}, {})".format(*below)] == ASKED_FOR_ONLY
        assert legend["rgb({}, {}, {})".format(*above)] == EXPORT_ONLY

        # Pointing inside each triangle names its pairs.
        assert point_at(page, "#output-mask", 0.25, 0.75).endswith(ASKED_FOR_ONLY)
        assert point_at(page, "#output-mask", 0.75, 0.25).endswith(EXPORT_ONLY)
        keep_screenshot(visit, "check")
        visit.assert_clean()


def test_a_passing_check_shows_just_its_table(browser: Browser, check_folder: Path) -> None:
    """The faithful export's page says every check passed and draws nothing."""
    sdpa(
        check_folder,
        *("check", "q.npy", "k.npy", "v.npy", "--causal"),
        *("--expect-output", "good.npy", "--html", "good.html"),
    )
    page_file = check_folder / "good.html"
    assert_size(page_file, most_kb=50)
    with open_page(browser, page_file) as visit:
        page = visit.page
        visit.assert_clean()
        assert re.fullmatch(r"all \d+ checks passed", page.inner_text("header .pass"))
        assert page.locator("table.lines td.pass").count() >= 3
        assert page.locator("table.lines td.fail").count() == 0
        assert page.locator("figure").count() == 0
        assert page.locator("#output-mask").count() == 0


# --- sdpa explain / compute --html: one slice, stage by stage ---------------------------


@pytest.mark.parametrize(
    "command", [("explain", "--query", "0"), ("compute",)], ids=["explain", "compute"]
)
def test_the_slice_page_shows_every_stage(
    browser: Browser, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """The scorecard example's page: a heat map for each stage (scores, masked scores,
    weights, output), the findings, and the terminal's text below; pointing at key 0
    of the weights reads the scorecard's weight, 0.8816."""
    shutil.copy(SAMPLES / "scorecard.yaml", tmp_path)
    sdpa(tmp_path, command[0], "scorecard.yaml", *command[1:], "--html", "slice.html")
    page_file = tmp_path / "slice.html"
    assert_size(page_file, most_kb=100)
    with open_page(browser, page_file) as visit:
        page = visit.page
        visit.assert_clean()
        assert_pictures_drawn(page)
        for stage in ("scores", "masked", "weights", "output"):
            assert page.locator(f"figure.heat#stage-{stage}").count() == 1, stage
        assert page.locator("h2", has_text="Findings").count() == 1
        assert "scorecard" in page.inner_text("pre")

        readout = point_at(page, "#stage-weights", 0.5 / 3, 0.5)
        found = re.fullmatch(r"query 0, key 0: ([0-9.]+) weight", readout)
        assert found, readout
        assert float(found[1]) == pytest.approx(0.88165, abs=1e-4)
        if command[0] == "explain":
            keep_screenshot(visit, "explain")
        visit.assert_clean()


LLAMA = """
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from sdpa_cli.capture import capture

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    initializer_range=0.2, attn_implementation="eager",
)
model = LlamaForCausalLM(config).eval()
words = ["<s>", "The", "cat", "sat", "on", "the", "mat", "."]
ids = torch.arange(1, 1 + len(words)).unsqueeze(0)
with capture(sys.argv[1], tokens=words, notify=lambda line: None), torch.no_grad():
    model(input_ids=ids)
"""


def test_a_captured_llama_with_its_tokens(browser: Browser, tmp_path: Path) -> None:
    """A random-init Llama captured with its tokens (``capture(tokens=...)``): its model
    page opens clean, a row per layer, and the patterns' axes read the tokens."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    script = tmp_path / "llama.py"
    script.write_text(LLAMA)
    proc = subprocess.run(
        [str(Path(sdpa_executable()).parent / "python"), str(script), "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=clean_environ(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    sdpa(tmp_path, "report", "model", "run/manifest.yaml", "--html", "llama.html")
    with open_page(browser, tmp_path / "llama.html") as visit:
        page = visit.page
        visit.assert_clean()
        assert page.locator("td.cell").count() == 2 * 4  # two layers, four query heads
        page.click('td.cell[data-case="1"][data-head="2"]')
        names = page.get_attribute(PATTERN, "data-xnames")
        assert names is not None
        assert json.loads(names) == ["<s>", "The", "cat", "sat", "on", "the", "mat", "."]
        assert 'query 7 "."' in point_at(page, PATTERN, 0.05, 0.97)
        visit.assert_clean()
