# Everything runs from the repo's own venv (.venv/), made by scripts/setup_venv.sh.
SHELL      := /bin/bash
PYTHON     ?= python3
VENV       := .venv
VPY        := $(VENV)/bin/python
REQ_FILES  := $(wildcard requirements*.txt)
MODELS_DIR := models
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup model test bench bench-gpu bench-serve serve serve-docker perf genai-perf clean distclean

help:
	@echo "make serve      start tritonserver on the model repository + the OpenAI API on 9000 (scripts/serve.sh)"
	@echo "make serve-docker  the same in the NGC tritonserver image (docker/Dockerfile)"
	@echo "make test       unit + engine + server tests on CPU (gpu-marked tests skipped)"
	@echo "make setup      create/update .venv (idempotent)"
	@echo "make model      build the tiny test models under $(MODELS_DIR)/ (idempotent)"
	@echo "make bench      decode benchmark (python -m bench.decode)"
	@echo "make bench-gpu  decode benchmark on CUDA"
	@echo "make bench-serve serving benchmark: tritonserver + perf_analyzer vs in-process vs steady decode"
	@echo "                (bench/serve.py; CPU smoke with the tiny model unless BENCH_SERVE_ARGS says otherwise)"
	@echo "make perf       perf_analyzer run (scripts/perf.sh)"
	@echo "make genai-perf genai-perf in its own venv build/genai-venv, short offline profile (scripts/genai_perf.sh)"
	@echo "make clean      remove models, caches and outputs (keeps .venv); distclean also removes .venv"

setup: $(VENV)/.stamp

# The stamp is written last, so a failed step reruns on the next `make setup`.
# scripts/install_triton.sh (tritonserver, clients, perf_analyzer) runs when present.
$(VENV)/.stamp: $(REQ_FILES) scripts/setup_venv.sh $(wildcard scripts/install_triton.sh)
	@rm -f $@
	PYTHON=$(PYTHON) VENV=$(VENV) REQ_FILES=requirements.txt scripts/setup_venv.sh
	@if [ -x scripts/install_triton.sh ]; then \
		echo "PATH=$(VENV)/bin:... scripts/install_triton.sh"; \
		PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/install_triton.sh; \
	fi
	@touch $@

# make_model.py is idempotent (stamp per folder), so calling it is a cheap no-op when
# the models are already there and up to date.
model: setup
	$(VPY) scripts/make_model.py --all --models-dir $(MODELS_DIR)

test: setup model
	$(VPY) -m pytest -q tests -m "not gpu" $(PYTEST_ARGS)

bench: setup model
	$(VPY) -m bench.decode

bench-gpu: setup model
	$(VPY) -m bench.decode --device cuda

# The serving benchmark (bench/serve.py). On a GPU machine with Triton installed:
#   make bench-serve BENCH_SERVE_ARGS="--preset qwen2.5-0.5b --device cuda"
# (the lent GPU has no Triton: bash bench/serve.sh, carrying the bundle of bench/gpu_bundle.sh)
BENCH_SERVE_ARGS ?= --smoke
bench-serve: setup model
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VPY) -m bench.serve $(BENCH_SERVE_ARGS)

serve: setup model
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/serve.sh

# The NGC image (docker/Dockerfile) running the same repository; models/ is mounted.
DOCKER_IMAGE ?= llm-triton:latest
DOCKER_GPUS  ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo --gpus all)
serve-docker: model
	DOCKER_BUILDKIT=1 docker build -f docker/Dockerfile -t $(DOCKER_IMAGE) .
	docker run --rm -it $(DOCKER_GPUS) --shm-size=1g \
		-p $${TRITON_BIND_ADDRESS:-127.0.0.1}:$${HTTP_PORT:-8000}:8000 \
		-p $${TRITON_BIND_ADDRESS:-127.0.0.1}:$${GRPC_PORT:-8001}:8001 \
		-p $${TRITON_BIND_ADDRESS:-127.0.0.1}:$${METRICS_PORT:-8002}:8002 \
		-v "$(CURDIR)/models:/opt/project/models:ro" \
		-e MODEL_PATH -e TRITON_ACCESS_KEY -e TRITON_OPEN_RESTRICTED_APIS \
		$(DOCKER_IMAGE)

perf: setup model
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/perf.sh

# genai-perf (numpy 2, pandas, transformers 5: ~950 MB, ~90 s to install) gets its own venv,
# build/genai-venv, and is not part of `make setup`; the server test skips without it.
genai-perf: setup model
	scripts/install_genai_perf.sh
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/genai_perf.sh

clean:
	rm -rf $(MODELS_DIR) build out .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -print0 | xargs -0 rm -rf

distclean: clean
	rm -rf $(VENV)
