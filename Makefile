# One entry point for newcomers and CI. Every target sets up its own virtual environment.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint typecheck unit run bench clean

# The data plane's Cython extensions are compiled by the install: a change to one rebuilds.
CYTHON_SOURCES := $(shell find exchange -name '*.pyx' -o -name '*.pxd')

$(STAMP): pyproject.toml setup.py $(CYTHON_SOURCES)
	@bash scripts/ensure-java.sh
	@bash scripts/ensure-compiler.sh $(PYTHON)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bench]'
	@touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check exchange server client tests bench
	$(VENV)/bin/ruff format --check exchange server client tests bench

typecheck: setup
	$(VENV)/bin/mypy exchange server client

unit: setup
	@bash scripts/ensure-prometheus.sh
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

# The test command the README gives and .ci/run calls.
test: lint typecheck unit

run: setup
	$(PY) -m client.main_job $(ARGS)

bench: setup
	@set -e; for f in bench/bench_*.py; do echo "== $$f"; $(PY) $$f; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build
	find exchange \( -name '*.so' -o -name '*.c' \) -delete
