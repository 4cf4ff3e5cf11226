# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv on first use and install the project into it.
# `make docs` builds the documentation site into site/, offline.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup demo run test bench docs gpu-wheels clean

# torch comes first, from TORCH_INDEX, the PyTorch index of its CPU builds
# (plain PyPI serves torch only as a CUDA build of several GB), alone; its
# dependencies come with the project from the usual indexes. pip's own
# configuration (a mirror, find-links) still applies beside it.
# constraints/cpu.txt pins the CPU build, so a machine that cannot reach one
# stops with an error instead of downloading CUDA. On a GPU machine:
#   make setup CONSTRAINTS='-c constraints/cuda.txt' TORCH_INDEX=https://download.pytorch.org/whl/cu130
CONSTRAINTS ?= -c constraints/cpu.txt
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

$(BIN)/.installed: pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --no-deps $(CONSTRAINTS) --index-url $(TORCH_INDEX) torch || { \
		echo "make: no torch build that $(CONSTRAINTS) allows was found at $(TORCH_INDEX) or in pip's own" \
			"configuration; set TORCH_INDEX to an index that has it (see docs/getting-started.md)" >&2; exit 1; }
	$(BIN)/pip install --quiet $(CONSTRAINTS) -e '.[worker,demo,test,bench,docs]'
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/kv-manager demo $(ARGS)

run: setup
	$(BIN)/kv-manager replay $(ARGS)

# Tests run in up to 4 processes (pytest-xdist; 2 on a 2-core machine); skipped tests print their reason.
# Heavy tests marked `thorough` are deselected unless HYPOTHESIS_PROFILE=thorough (as .ci/run sets) or
# ARGS has a -m expression: `make test ARGS='-m thorough'` runs only them (tests/conftest.py).
# The system packages they use are installed first when missing (tools/system-packages.sh).
test: setup
	tools/system-packages.sh
	$(BIN)/python -m pytest -q -rs -n auto --maxprocesses 4 $(ARGS)

bench: setup
	$(BIN)/python bench/core_bench.py $(ARGS)

# MkDocs (the docs extra, pinned in the constraints) builds mkdocs.yml's pages with its own theme:
# nothing is downloaded, and the pages load nothing from the network. --strict fails on any warning:
# a broken link or anchor, a page left out of the nav.
docs: setup
	$(BIN)/mkdocs build --strict $(ARGS)

# The wheels bench/gpu_check.py installs on a GPU machine that reaches no package index
# (CPython 3.12, manylinux x86-64), into the git-ignored .gpu-wheels/ (docs/gpu-check.md).
gpu-wheels: setup
	$(BIN)/python tools/gpu_wheels.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis site
