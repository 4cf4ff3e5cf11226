# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and install the project into it.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup demo run test bench clean

# CPU machines take the CPU build of torch (constraints/cpu.txt); on a GPU
# machine run `make setup CONSTRAINTS=` after installing torch for its CUDA.
CONSTRAINTS ?= -c constraints/cpu.txt

$(BIN)/.installed: pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(CONSTRAINTS) -e '.[worker,demo,test,bench]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/kv-manager demo $(ARGS)

run: setup
	$(BIN)/kv-manager replay $(ARGS)

# Tests run in up to 4 processes (pytest-xdist; 2 on a 2-core machine); skipped tests print their reason.
test: setup
	$(BIN)/python -m pytest -q -rs -n auto --maxprocesses 4 $(ARGS)

bench: setup
	$(BIN)/python bench/core_bench.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
