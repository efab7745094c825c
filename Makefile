# kvpilot — every target sets itself up (virtualenv, Debian packages, cluster binaries).
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY := .venv/bin/python
PYTEST_ARGS ?=
comma := ,
LOCK_ARGS ?=

.PHONY: help setup system-deps lint test unit bench llama-server crds cluster-build cluster-up cluster-down \
        lock lock-check gptq-refs \
        cluster-env demo demo-down images

help:
	@echo "make demo        bring up the dev cluster with its fake GPU node pools and show them"
	@echo "make test        lint + all tests (unit, local control plane) — what CI runs"
	@echo "make lint        lock check + ruff + mypy"
	@echo "make lock        re-resolve uv.lock after editing pyproject.toml's dependencies (needs PyPI;"
	@echo "                 LOCK_ARGS=--upgrade moves every package to its newest allowed version)"
	@echo "make lock-check  fail when uv.lock does not match pyproject.toml (offline, ~0.1 s)"
	@echo "make bench       run the benchmarks and rewrite docs/benchmarks.md (the first run builds"
	@echo "                 llama.cpp's llama-server for bench.engine_peer, ~5 min on 2 cores;"
	@echo "                 BENCH_SKIP=engine_peer leaves that benchmark out)"
	@echo "make llama-server  build (or find) the cached llama-server the peer benchmark runs"
	@echo "make gptq-refs   write (once per GPTQModel version) the GPTQ/AWQ checkpoints GPTQModel makes for"
	@echo "                 tests/runtime/test_rt_gptq_awq.py, in its own tool venv (hack/gptq_tools.sh)"
	@echo "make crds        regenerate crds/ from the pydantic API models (and deploy/base)"
	@echo "make images      build the operator and runtime OCI images without Docker (as root: mmdebstrap,"
	@echo "                 umoci; IMAGE=kvpilot-operator builds one) into ~/.cache/kvpilot/images/, from"
	@echo "                 cached layers (base, venv, kernels, app); IMAGES_FLAGS=--refresh rebuilds all"
	@echo "make cluster-up / cluster-down / cluster-env   the local control plane (hack/devcluster)"

system-deps:
	@bash hack/system-deps.sh

setup: system-deps
	@bash hack/venv.sh

# uv.lock pins every dependency; hack/venv.sh installs from it and checks it first, so `make lint`
# and `make test` fail on a stale lock. Keeps unchanged pins unless LOCK_ARGS=--upgrade.
lock:
	@bash hack/uv.sh lock $(LOCK_ARGS)

lock-check:
	@bash hack/lock_check.sh && echo "uv.lock matches pyproject.toml"

lint: setup
	@echo "==> ruff"
	@$(PY) -m ruff check .
	@$(PY) -m ruff format --check .
	@echo "==> mypy"
	@MYPY_CACHE_DIR=$${KVPILOT_CACHE_DIR:-$$HOME/.cache/kvpilot}/mypy $(PY) -m mypy

cluster-build: setup
	@$(PY) -m hack.devcluster build

unit: setup
	$(PY) -m pytest -q -m "not slow and not cluster and not e2e and not kind" $(PYTEST_ARGS)

# GPTQModel is no dependency of the project: its tool venv (hack/gptq_tools.sh) writes tiny-llama's
# GPTQ/AWQ checkpoints and their dequantised reference once per (its version, the writer, the
# model) into ~/.cache/kvpilot/gptq-refs, which tests/runtime/test_rt_gptq_awq.py reads. Offline
# on a cold cache it says so and those tests skip; a GPTQModel failure fails the set-up.
gptq-refs: setup
	@$(PY) -m bench.reference.gptq_awq

test: lint cluster-build gptq-refs
	@echo "==> pytest (the tests start their own control plane, runtime processes and Prometheus)"
	$(PY) -m pytest -q -rs --durations=15 $(PYTEST_ARGS)

# BENCH_SKIP: benchmarks to leave out, by module name (spaces or commas), e.g.
# `make bench BENCH_SKIP=engine_peer`: that one builds llama.cpp's llama-server the first time
# (~5 min on 2 cores, cached under ~/.cache/kvpilot keyed by version; `make llama-server` builds
# it alone). `make test` never builds it.
BENCH_SKIP ?=
bench: setup
	@skip=" $(subst $(comma), ,$(BENCH_SKIP)) "; \
	for s in $$skip; do \
	  [ -f "bench/$$s.py" ] || { echo "BENCH_SKIP: no benchmark bench/$$s.py (names: $$(cd bench && ls [a-z]*.py | sed 's/\.py$$//' | tr '\n' ' '))"; exit 2; }; \
	done; \
	for b in bench/*.py; do \
	  case "$$b" in */__init__.py|*/report.py|*/*_common.py) continue;; esac; \
	  m=$${b%.py}; m=$${m//\//.}; \
	  case "$$skip" in *" $${m#bench.} "*) echo "==> $$m skipped (BENCH_SKIP)"; continue;; esac; \
	  echo "==> $$m"; $(PY) -m $$m || exit 1; \
	done

llama-server: setup
	@$(PY) -m bench.llama_cpp_common

crds: setup
	$(PY) -m kvpilot.operator.crdgen
	$(PY) deploy/render.py

# Container images without a Docker engine (hack/images: mmdebstrap, the locked venv, umoci), as
# OCI layouts under ~/.cache/kvpilot/images/<version>/; IMAGE=kvpilot-operator builds just one.
# Layers are cached by their own inputs (~/.cache/kvpilot/layers): a source change repacks only
# the app layer; IMAGES_FLAGS=--refresh rebuilds every layer (Debian's security updates).
# Layers no cached image uses are pruned after each build.
# The Dockerfiles describe the same images for `docker build` (tests/packaging/test_images.py).
IMAGE ?=
images: system-deps setup
	@$(PY) -m hack.images $(IMAGE) $(IMAGES_FLAGS)

# IMAGES=1: the local pool's pods run from the images `make images` cached, not the host's venv
cluster-up: cluster-build
	@$(PY) -m hack.devcluster up $(if $(IMAGES),--images)

cluster-down: setup
	@$(PY) -m hack.devcluster down

cluster-env: setup
	@$(PY) -m hack.devcluster env

demo: cluster-up
	@$(PY) -m hack.demo

demo-down: cluster-down
