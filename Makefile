# The two commands a new user runs: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is pinned to the CPU build that these machines install from local disk;
# any other request pulls a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	@echo "== make: installing into $(VENV) (first run only, a few minutes): pip, torch 2.13.0 (CPU), cpshard[test] =="
	$(BIN)/pip install --progress-bar off --upgrade pip
	@echo "== make: installing torch==2.13.0 (CPU build) =="
	$(BIN)/pip install --progress-bar off torch==2.13.0
	@echo "== make: installing cpshard and its test extras (transformers, trl, accelerate, pytest, ruff, mypy) =="
	$(BIN)/pip install --progress-bar off -e '.[test]'
	@echo "== make: install done =="
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/cpshard parity

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy
	OMP_NUM_THREADS=1 $(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_token_verbs.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
