# The two commands a new user runs: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean test-compat

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

# The GPU image's versions (torch 2.11, transformers 5.17) on the CPU: a second venv, the CPU
# suite. PyPI has no CPU wheel of torch 2.11 for x86_64 (only the CUDA build, several GB with its
# nvidia-* wheels; it runs on the CPU), so the first build downloads that; later runs reuse it.
COMPAT := .venv-compat
COMPAT_STAMP := $(COMPAT)/.installed

$(COMPAT_STAMP): pyproject.toml
	$(PY) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install -q --upgrade pip
	$(COMPAT)/bin/pip install -q torch==2.11.0 'transformers==5.17.*'
	$(COMPAT)/bin/pip install -q -e '.[test]' torch==2.11.0 'transformers==5.17.*'
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	$(COMPAT)/bin/python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
	OMP_NUM_THREADS=1 $(COMPAT)/bin/pytest

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_token_verbs.py

clean:
	rm -rf $(VENV) $(COMPAT) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
