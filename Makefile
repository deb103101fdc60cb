# Two commands matter: `make serve` (the main job on the bundled model) and `make test` (the suite).
# Both set up everything from nothing: a fresh machine needs only python3.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: setup serve generate test test-fast lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test,parity]"
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/jaxcpp serve --model tiny --host 127.0.0.1 --port 50051

generate: $(STAMP)
	$(BIN)/jaxcpp generate --model tiny --prompt "def fibonacci(n):" --max-tokens 64

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
