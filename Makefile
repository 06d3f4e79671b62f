# Two entry points (see README): `make train` and `make test`. Both create .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

.PHONY: setup train test test-slow
setup: $(STAMP)

train: $(STAMP)
	$(BIN)/ndtrain train

test: $(STAMP)
	$(BIN)/pytest -m "not slow"

test-slow: $(STAMP)
	$(BIN)/pytest -m slow
