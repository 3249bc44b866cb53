# Two entry points for a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment if it is missing. torch is installed
# first from its CPU wheel so that no CUDA build is fetched.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.autopar-installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

.PHONY: install demo test test-all
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m autopar demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m '' tests
