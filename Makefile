# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv on first use and reinstalls when pyproject.toml changes.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TRACE  ?= ../shared/data/mooncake_synthetic_trace.jsonl
# torch is installed first and pinned, so pip takes a local wheel (e.g. a CPU build offered by
# find-links) instead of resolving the newest CUDA build (several GB); TORCH=... to change it
TORCH ?= torch==2.13.0
# e.g. DEMO_ARGS="--duration 60 --no-browser" for a headless run
DEMO_ARGS ?=
# pytest-xdist workers for `make test`, each taking whole test files: most functional tests wait
# on the processes they start, so one more worker than cores (3 on 2 cores about halve the
# suite's time), at most 8 (each holds torch and the processes its tests start); 0 runs it in
# one process (e.g. for --snapshot-update)
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); n=$$((n + 1)); echo $$((n < 3 ? 3 : n > 8 ? 8 : n)))
# Python caches compiled modules (__pycache__, git-ignored) even where the environment asks it
# not to: every agent and CLI the tests and the demo start would otherwise compile kvctl's
# hundred-odd modules from source again (about 0.5 s of CPU each, hundreds of processes a run)
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test lint bench clean

# --no-compile: pip would byte-compile every module of every package (all of torch's); Python
# compiles what is imported on first use instead (an install took 86 s, 54 s with it)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --no-compile "$(TORCH)"
	$(BIN)/python -m pip install --quiet --no-compile -e ".[all,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvctl demo --trace $(TRACE) $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# style, the layer contracts of pyproject.toml (ARCHITECTURE.md) and strict typing of the core
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/kvctl bench store --json

clean:
	rm -rf $(VENV) build *.egg-info
