# sdpa developer commands. `make demo` and `make test` do all the set-up on a fresh clone.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: install demo test test-fast test-wheel docs lint fmt golden bench bench-quick bench-grad bench-gate bench-pages fuzz clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The runtime install (what a user gets).
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e .
	touch $@

# The dev install: test and lint tools on top, and PyTorch's CPU build, a reference the
# tests cross-check against (never a runtime requirement): where it cannot be
# installed, the tests that need it skip, each saying so. And Debian's chromium, in which
# tests/pages open the HTML reports headless (Playwright's client drives it; it never
# downloads a browser): installed as root where apt-get is (the package lists refreshed
# when the first try fails); elsewhere those tests skip, saying so.
CHROMIUM_INSTALL = DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium

$(VENV)/.dev-installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet torch==2.13.0 \
		|| echo "torch not installable: the tests and figures that need it are skipped"
	command -v chromium >/dev/null \
		|| { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
			&& { $(CHROMIUM_INSTALL) || { apt-get update -q && $(CHROMIUM_INSTALL); }; }; } \
		|| echo "chromium not installed: the browser tests (tests/pages) are skipped"
	touch $(VENV)/.installed $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/sdpa compute samples/scorecard.yaml --no-color
	$(BIN)/sdpa compute samples/causal.yaml --stages masked,weights,output --no-color
	$(BIN)/sdpa explain samples/scorecard.yaml --query 0 --no-color

test: $(VENV)/.dev-installed
	$(BIN)/python -m pytest -q

# Everything but the end-to-end tests (marked e2e: they run the installed sdpa in a
# subprocess, the README's examples included).
test-fast: $(VENV)/.dev-installed
	$(BIN)/python -m pytest -q -m "not e2e"

# The wheel as a user gets it: the sdist and the wheel built from it (python -m build,
# failing on any setuptools warning), installed into a clean venv in a temporary folder
# outside the repository (dependencies from the index), and there `sdpa --version`,
# `sdpa samples --copy .` and every example of every --help run, each exiting 0 or 1
# (tests/wheel_smoke.py; --keep keeps the folder: SMOKE_ARGS=--keep). About a minute.
SMOKE_ARGS ?=
test-wheel: $(VENV)/.dev-installed
	$(BIN)/python tests/wheel_smoke.py $(SMOKE_ARGS)

# The documentation site (mkdocs.yml, docs/) into site/; any warning fails.
docs: $(VENV)/.dev-installed
	$(BIN)/mkdocs build --strict --site-dir site

lint: $(VENV)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

fmt: $(VENV)/.dev-installed
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Re-render the golden text files under tests/golden; review them in the diff.
golden: $(VENV)/.dev-installed
	SDPA_REGEN_GOLDEN=1 $(BIN)/python -m pytest -q tests/render/test_render.py \
		tests/render/test_render_explain.py tests/render/test_render_check.py \
		tests/render/test_render_grad.py tests/render/test_render_inspect.py

# The performance figures, each beside its target, in one run: `sdpa check` vs PyTorch's
# SDPA kernel, cost per score from L 1024 to 16384, peak RSS of every command, `sdpa grad`
# vs torch autograd, start-up, a manifest on a local Dask cluster vs --jobs 2. Ends with
# a Markdown table (figure | measured | target | verdict) for the README. A report, not a
# test (the better part of an hour); bench-quick runs small shapes (a few minutes).
# Without torch (not installable here) its figures are skipped. More options: BENCH_ARGS="--only grad --repeat 3
# --json bench.json" (bench/bench.py --help).
BENCH_ARGS ?=

bench: $(VENV)/.dev-installed
	$(BIN)/python bench/bench.py $(BENCH_ARGS)

bench-quick: $(VENV)/.dev-installed
	$(BIN)/python bench/bench.py --quick $(BENCH_ARGS)

# Fuzz the command line (tests/cli/test_fuzz.py) for FUZZ_SECONDS: rounds of FUZZ_EXAMPLES
# fresh random examples per test until the time is spent (each test stops at its next
# example once it is: SDPA_FUZZ_UNTIL, so the run ends within seconds of it). Stops at the first failure; hypothesis keeps it in .hypothesis/ and
# replays it first next time. `make test` runs a small fixed set of the same tests.
FUZZ_SECONDS  ?= 600
FUZZ_EXAMPLES ?= 500
fuzz: $(VENV)/.dev-installed
	@end=$$(( $$(date +%s) + $(FUZZ_SECONDS) )); round=1; \
	while [ $$(date +%s) -lt $$end ]; do \
		echo "fuzz round $$round: $$(( end - $$(date +%s) )) s left"; \
		SDPA_FUZZ=1 SDPA_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SDPA_FUZZ_UNTIL=$$end $(BIN)/python -m pytest -q \
			-p no:cacheprovider tests/cli/test_fuzz.py || exit 1; \
		round=$$((round + 1)); \
	done; echo "fuzz: $$((round - 1)) rounds, no failure"

# `sdpa grad` beside PyTorch's float64 autograd, and its peak RSS at every length: the
# grad figures of `make bench` alone.
bench-grad: $(VENV)/.dev-installed
	$(BIN)/python bench/bench.py --only grad $(BENCH_ARGS)

# The verdict benchmark: does `sdpa check`, with no tolerance flag, pass every
# faithful export of a real kernel, fail every real bug and name it? Kernels: PyTorch's
# CPU SDPA (fused and math), Hugging Face eager attention in tiny random Llama, Mistral,
# Gemma 2, BERT and ModernBERT models (built from configs, nothing downloaded), JAX's XLA
# attention; float16, bfloat16 and float32. Bugs: one head shifted by 1, 2, 4, 8 × its
# error, a rolled row, scale 1/d_k, an inverted mask, a window off by one, a flipped
# causal alignment, the causal mask transposed, packed documents leaking, the
# temperature forgotten, (B, L, H, E) tensors or output alone read as (B, H, L, E), an
# LSE in base 2, bfloat16 claimed as float32. Backward exports (--dout, --expect-dq/dk/dv)
# of the same kernels, and their slips: dK without the scale, D = rowsum(dO ⊙ O) left
# out, dV from unnormalised weights, the mask in the forward pass only, grouped-query
# gradients unsummed, one head's dQ shifted. Noise: causal random data, float16 randn
# inspected, a captured model's manifest. Prints a confusion table, a table per bug
# (caught, named), the noise, every wrong verdict and unnamed bug, and Markdown tables;
# exits 1 on any false failure, false pass, false alarm or --fudge offered over a
# structural error. About 4 minutes on 2 cores; a library that cannot be installed
# skips its kernels. More options: BENCH_ARGS="--only hf-gemma2 --keep /tmp/gate --json
# gate.json" (bench/bench_gate.py --help).
BENCH_GATE_LIBS = $(BIN)/pip install --quiet transformers==5.24.0 jax==0.10.2 \
	|| echo "bench-gate: transformers or jax not installable; their kernels are skipped"

bench-gate: $(VENV)/.dev-installed
	$(BENCH_GATE_LIBS)
	$(BIN)/python bench/bench_gate.py $(BENCH_ARGS)

# The model page of a 32-layer × 32-head capture at 4,096 tokens: `report model` and
# `check --manifest` without and with --html, the page's size, the time headless
# Chromium takes to open it (about 10 minutes on 2 cores; BENCH_ARGS="--layers 4" for
# a quick look; bench/bench_pages.py --help).
bench-pages: $(VENV)/.dev-installed
	$(BIN)/python bench/bench_pages.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist site
