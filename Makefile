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

# The suite on an older torch (CI runs it after `make test`): unit tests and the 2-process job in
# a second environment. PyPI's torch 2.11 is a CUDA build (about 5 GB with its libraries); it
# runs on the CPU.
OLD_TORCH ?= 2.11.0
OLD_VENV := .venv-torch$(OLD_TORCH)

.PHONY: install demo test test-all test-old-torch
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m autopar demo

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 tests

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m '' tests

test-old-torch:
	test -x $(OLD_VENV)/bin/python || $(PY) -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLD_VENV)/bin/python -m pip install -q torch==$(OLD_TORCH)
	$(OLD_VENV)/bin/python -m pip install -q -e '.[test]'
	$(OLD_VENV)/bin/python -m pytest -q tests/unit
	$(OLD_VENV)/bin/python -m pytest -q tests/distributed/test_equivalence.py -k 2proc
