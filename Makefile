# Two commands on a fresh machine: `make demo` runs the pipeline on the built-in demo,
# `make test` runs the tests. Each creates the virtualenv (.venv) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint install clean

# jacobeam and what the README's quickstart uses (matplotlib for `inspect --plot`); the tests' tools on top.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[plot]'
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(BIN)/jacobeam demo

# Two pytest-xdist processes, one test file each at a time, longest first (tests/conftest.py); WORKERS=0
# runs in one.
WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder

test: $(VENV)/.installed-test
	$(PYTEST)

# The edit loop: no multi-process or subprocess tests, fewer hypothesis examples (docs/development.md).
test-fast: $(VENV)/.installed-test
	JACOBEAM_HYPOTHESIS_PROFILE=fast $(PYTEST) -m "not slow"

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) jacobeam-demo
