# Two commands do everything on a fresh clone: `make bench` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_ARGS ?=

.PHONY: bench test lint clean

$(STAMP): pyproject.toml setup.py src/sarp/_native.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[bench,test]'
	touch $(STAMP)

bench: $(STAMP)
	$(BIN)/sarp bench --json bench-results/builtin.json --plot bench-results/builtin.png $(BENCH_ARGS)

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) bench-results .pytest_cache
