# Two entry points for a fresh machine: `make run` and `make test`.
# Both create .venv on first use and install the project into it.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup run test bench clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/kv-manager replay $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/python bench/core_bench.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
