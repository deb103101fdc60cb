# Two commands matter: `make serve` (the main job on the bundled model) and `make test` (the suite).
# Both set up everything from nothing: a fresh machine needs only Python >= 3.11 (PY=... picks one).
# `serve`/`generate` install the package alone; `test`/`setup` add the test and parity extras (torch).
# A setup that fails removes the venv, so the next run starts clean instead of reusing a broken one.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PKG_STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
MIN_PY  := 3.11

.PHONY: setup serve generate test test-fast lint gpu-check clean

# The version check runs before the venv is created; its message names the interpreter and version.
# It runs only when there is no venv yet: one made with PY=python3.12 keeps working whatever python3 is.
CHECK_PYTHON = found=$$($(PY) -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) \
	  || { echo "make: cannot run '$(PY)' as Python; give one >= $(MIN_PY): make ... PY=/path/to/python3.11" >&2; \
	       exit 1; }; \
	if [ "$$(printf '%s\n%s\n' "$(MIN_PY)" "$$found" | sort -V | head -n 1)" != "$(MIN_PY)" ]; then \
	  echo "make: $$(command -v $(PY) || echo $(PY)) is Python $$found; jaxcpp needs Python >= $(MIN_PY):" \
	       "make ... PY=/path/to/python3.11 (or newer)" >&2; \
	  exit 1; \
	fi
SETUP_FAILED = { rm -rf $(VENV); echo "make: setup failed; removed $(VENV) so the next run starts clean" >&2; exit 1; }
# A recent pip (26.3 here) shows the build backend's warnings despite --quiet, and setuptools warns at every editable
# install that a folder named like the package in the working directory may shadow it (LINK_PACKAGE
# below is what jaxcpp does about that): only that banner is silenced.
PIP = PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip

# Python puts the current directory first on sys.path, so in the folder that holds this clone the clone's
# own folder (named jaxcpp) is found first, as an empty namespace package that hides the installed one
# ("cannot import name 'LLM' from 'jaxcpp'"). A sys.path entry holding the real package wins over it (a
# regular package beats a namespace portion wherever it sits on the path): $(VENV)/jaxcpp-path holds a
# link to it, named in a .pth file; jaxcpp.models and the other mapped folders still come from the
# editable install.
LINK_PACKAGE = mkdir -p $(VENV)/jaxcpp-path && ln -sfn $(CURDIR)/jaxcpp $(VENV)/jaxcpp-path/jaxcpp \
	  && for sp in $(VENV)/lib/python3*/site-packages; do echo "$(abspath $(VENV))/jaxcpp-path" > $$sp/jaxcpp-path.pth; done

# Build, then stamp; on any failure remove the venv (a half-made one would be reused by the next run).
$(PKG_STAMP): pyproject.toml constraints.txt
	@if [ ! -x $(BIN)/python ]; then $(CHECK_PYTHON); fi
	@{ [ -x $(BIN)/python ] || $(PY) -m venv $(VENV); } \
	  && $(PIP) install --quiet --upgrade pip \
	  && $(PIP) install --quiet -c constraints.txt -e . \
	  && $(LINK_PACKAGE) \
	  && touch $@ \
	  || $(SETUP_FAILED)

$(TEST_STAMP): $(PKG_STAMP) pyproject.toml constraints.txt
	@$(PIP) install --quiet -c constraints.txt -e ".[test,parity]" \
	  && touch $@ \
	  || $(SETUP_FAILED)

setup: $(TEST_STAMP)

serve: $(PKG_STAMP)
	$(BIN)/jaxcpp serve --model tiny --host 127.0.0.1 --port 50051

generate: $(PKG_STAMP)
	$(BIN)/jaxcpp generate --model tiny --prompt "def fibonacci(n):" --max-tokens 64

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q --durations=15

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

# On a machine with a GPU and a GPU build of jax (maybe no network): installs nothing, runs the checks that
# need a GPU within 8 minutes, writes out/gpu-check/gpu_check.{json,md}; without a GPU it says so, exit 0.
gpu-check:
	python3 benchmarks/gpu_check.py --out out/gpu-check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
