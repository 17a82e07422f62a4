# Both targets create .venv on first use and install into it, so each works on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck install install-test gate

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[host]'

install-test: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'

demo: install
	$(BIN)/qir demo

lint: install-test
	$(BIN)/ruff check qir tests benchmarks
	$(BIN)/ruff format --check qir tests benchmarks

typecheck: install-test
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -q -n auto

# The compile gate's whole matrix: every kernel entry for every arch (`make test` builds each
# entry for sm_90 and one other arch; tests/runtime/test_compile_gate.py).
gate: install-test
	QIR_GATE=all $(BIN)/python -m pytest -q -n auto tests/runtime/test_compile_gate.py
