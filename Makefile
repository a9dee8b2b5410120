# make test  : bootstrap .venv (TORCH_SPEC, pinned test deps) and run lint + the test suite
# make demo  : bootstrap .venv and run speculative decoding with the embedded Laguna + DFlash pair
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# the suite runs on this many processes (pytest-xdist); 0 runs it in this one
PYTEST_WORKERS ?= 2

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps dflash==0.1.0
	touch $@

.PHONY: install test lint demo clean
install: $(VENV)/.installed

lint: install
	$(PY) -m ruff check laguna_dflash tests benchmarks

test: lint
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/laguna-dflash generate "def quicksort(arr):"

clean:
	rm -rf $(VENV) .demo-pair .pytest_cache
