# Two commands on a fresh machine: `make demo` runs the pipeline on the built-in demo,
# `make test` runs the tests. Each creates the virtualenv (.venv) on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/jacobeam demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

# The edit loop: no multi-process or subprocess tests, fewer hypothesis examples (docs/development.md).
test-fast: $(VENV)/.installed
	JACOBEAM_HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -q -m "not slow"

lint: $(VENV)/.installed
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) jacobeam-demo
