# Two commands do everything on a fresh machine: `make train` and `make test` (each sets up .venv first).
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= examples/agentic_sokoban.yaml

.PHONY: setup train test test-fast lint bench docs

setup:
	@bash scripts/setup_venv.sh

train: setup
	$(BIN)/agentrl train $(CONFIG)

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder   # units and their order: tests/conftest.py

test-fast: setup  # the inner loop (a minute or two): no slow or heavy test; not a replacement for `make test`
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder -m "not slow and not heavy"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

docs: setup  # the documentation site (docs/, mkdocs-material) into site/; broken links fail it
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b; done
