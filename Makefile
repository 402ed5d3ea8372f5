# The two set-up commands (see README): `make demo` runs the main job, `make test` the test suite.
# Both create .venv if missing and install; the second time the install is a quick no-op.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ragen-installed
# Applies to pip's build environments too, so no package build pulls a CUDA torch.
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export RAGEN_DATA_DIR ?= $(CURDIR)/data
# Prefect's ephemeral server may take longer than its default 20 s to start on a busy 2-core machine.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120

.PHONY: install demo test test-slow bench lint typecheck clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip check >/dev/null || $(PY) -m pip check
	@$(PY) -c "import torch, sys; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ragen demo

# Lint and type-check first: a finding fails the run before the (long) suite starts.
test: lint typecheck
	$(PY) -m pytest -q -m "not slow and not vllm" -p no:cacheprovider

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow or integration" -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check ragen_core tasks flows tests bench

# Files and strictness come from [tool.mypy] in pyproject.toml.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
