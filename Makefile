# The two commands of the README: `make demo` and `make test`. Both create or update .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/zoo fit --config configs/quickstart.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check zoo tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/moe_dispatch.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/elastic.py

clean:
	rm -rf $(VENV) lightning_logs runs
