# Two commands do everything on a fresh clone: `make bench` and `make test`.
PYTHON ?= python3
VENV := .venv
DYNAMO := .venv-dynamo
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_ARGS ?=
SOAK_S ?= 120

.PHONY: bench test lint soak clean dynamo wheel

# sarp._native (the match walk and the batch write in C) builds with the system's C compiler; without one
# (or with SARP_USE_ZIG=1) with zig's, from the ziglang wheel. If neither can build it,
# the install goes on and sarp runs its Python path (sarp.native.AVAILABLE says which; SARP_REQUIRE_NATIVE=1 makes that an error).
$(STAMP): pyproject.toml setup.py src/sarp/native.c src/sarp/verify.c src/sarp/packing.c src/sarp/serving/events.c src/sarp/serving/http.c src/sarp/tokenkeys.c src/sarp/directory.c src/sarp/segment.c src/sarp/valkey_read.c src/sarp/serving/rfc.c src/sarp/serving/wire.c src/sarp/aliastable.c src/sarp/native.h
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	if [ -n "$$SARP_USE_ZIG" ] || ! command -v cc >/dev/null 2>&1; then \
	  if $(BIN)/python -m pip install --quiet ziglang; then \
	    echo "building sarp._native with zig cc (the ziglang wheel)"; \
	    zig=$$($(BIN)/python -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')/zig; \
	    printf '#!/bin/sh\nexec "%s" cc "$$@"\n' "$$zig" > $(VENV)/zig-cc && chmod +x $(VENV)/zig-cc; \
	    export CC="$(CURDIR)/$(VENV)/zig-cc" LDSHARED="$(CURDIR)/$(VENV)/zig-cc -shared"; \
	  fi; \
	fi; \
	$(BIN)/python -m pip install --quiet -e '.[bench,test]'
	# bytecode compiled as a wheel's install compiles it (an editable install does not,
	# and with PYTHONDONTWRITEBYTECODE set every start of serve compiled ~60 modules)
	$(BIN)/python -m compileall -q src/sarp >/dev/null
	$(BIN)/python -c "import sarp.native as n; print('sarp: hot loops in', 'C' if n.C else 'Python (sarp._native ' + (n.WHY or 'off: SARP_PURE_PYTHON') + ')')"
	touch $(STAMP)

bench: $(STAMP)
	$(BIN)/sarp bench --json bench-results/builtin.json --plot bench-results/builtin.png $(BENCH_ARGS)

# Dynamo's standalone indexer (ai-dynamo-runtime 1.6.1), the reference of the RFC #1403
# conformance test, in a venv of its own; a failed install leaves FAILED and the test skips.
$(DYNAMO)/.installed:
	rm -rf $(DYNAMO) && $(PYTHON) -m venv $(DYNAMO)
	$(DYNAMO)/bin/python -m pip install --quiet "ai-dynamo-runtime==1.6.1" && touch $@ || \
	  echo "pip install ai-dynamo-runtime==1.6.1 failed (see make's output)" > $(DYNAMO)/FAILED

dynamo: $(DYNAMO)/.installed

test: $(STAMP) $(DYNAMO)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q

# serve under every fault at once (docs/design.md, "Faults"), on LMDB, then on Valkey
soak: $(STAMP)
	$(BIN)/python -m sarp.bench.soak --seconds $(SOAK_S) --json bench-results/soak-lmdb.json
	$(BIN)/python -m sarp.bench.soak --seconds $(SOAK_S) --valkey --json bench-results/soak-valkey.json

# dist/: the sdist, and a manylinux wheel with sarp._native inside (auditwheel checks it
# links nothing beyond glibc, and tags it): `pip install dist/sarp-*.whl` needs no compiler
wheel: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist/raw .
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/auditwheel repair --wheel-dir dist dist/raw/sarp-*.whl
	mv dist/raw/sarp-*.tar.gz dist/ && rm -rf dist/raw
	@ls dist

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) $(DYNAMO) bench-results .pytest_cache dist
