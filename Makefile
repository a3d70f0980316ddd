# mhaserve: `make serve` and `make test` are all a fresh clone needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
REPOSITORY ?= models
MODEL ?= all-minilm-l6-v2
PYTEST_ARGS ?=

.PHONY: help install install-dev serve export test lint format typecheck pytest proto gpu-check clean

help:
	@echo "make serve      set up .venv, export $(MODEL) into $(REPOSITORY)/ if missing, start the server"
	@echo "make test       set up .venv with the dev extras, run lint, type checks and the whole test suite"
	@echo "make export     (re)export the default model as a new version"
	@echo "make proto      regenerate the gRPC stubs from proto/**/*.proto"
	@echo "make gpu-check  parity and a short throughput run on CUDAExecutionProvider (needs a GPU)"
	@echo "make reliability  the long reliability runs (bad input, overload, faults, soak, shutdown); writes docs/reliability.md"
	@echo "make images     the cpu and loadtest images with docker or podman, whichever answers; GPU=1: gpu and loadtest"

# One environment; each stamp records which extras are installed and is redone when a pyproject.toml changes.
# Two distributions share the `mhaserve` namespace: the server (this folder) and the load-test tooling
# (loadtest/, `mhaserve.loadtest`), which the serving images leave out.
$(VENV)/.stamp-serve: pyproject.toml loadtest/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[export]' -e ./loadtest
	@$(MAKE) --no-print-directory check-ort
	@touch $@

$(VENV)/.stamp-dev: pyproject.toml loadtest/pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' -e ./loadtest
	@$(MAKE) --no-print-directory check-ort
	@touch $@ $(VENV)/.stamp-serve

install: $(VENV)/.stamp-serve
install-dev: $(VENV)/.stamp-dev

# onnxruntime and onnxruntime-gpu install the same module and overwrite each other: refuse a mixed venv.
.PHONY: check-ort
check-ort:
	@if $(PY) -m pip show -q onnxruntime >/dev/null 2>&1; then \
	  echo "error: the CPU 'onnxruntime' package is installed beside onnxruntime-gpu (something pulled it in);" \
	       "remove .venv and run make again" >&2; exit 1; fi

# The default model is exported once; `make export` adds a new version on demand.
$(REPOSITORY)/$(MODEL)/1/manifest.json: | $(VENV)/.stamp-serve
	$(BIN)/mhaserve export --repository $(REPOSITORY) --name $(MODEL) --version 1 --optimize

export: $(VENV)/.stamp-serve
	$(BIN)/mhaserve export --repository $(REPOSITORY) --name $(MODEL) --optimize

serve: $(VENV)/.stamp-serve $(REPOSITORY)/$(MODEL)/1/manifest.json
	$(BIN)/mhaserve serve --repository $(REPOSITORY) --model $(MODEL)

# On a GPU host: the session must really get CUDAExecutionProvider; parity against the CPU, then a short
# throughput run through the server (testing/gpu_check.py), then the tests marked gpu.
gpu-check: $(VENV)/.stamp-dev $(REPOSITORY)/$(MODEL)/1/manifest.json
	$(PY) -m mhaserve.testing.gpu_check --repository $(REPOSITORY) --model $(MODEL)
	$(PY) -m pytest -m gpu -rs $(PYTEST_ARGS)

test: lint typecheck pytest

lint: $(VENV)/.stamp-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV)/.stamp-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# mypy cannot follow the editable install's import hook, so it reads the package through a tree of links
# that lays the folders out as they install (build/typecheck/mhaserve/service -> service/, ...); its
# messages name files by that path.
NAMESPACE_DIRS := model runtime export service proto cli testing loadtest
typecheck: $(VENV)/.stamp-dev
	@rm -rf build/typecheck && mkdir -p build/typecheck/mhaserve
	@for d in $(NAMESPACE_DIRS); do ln -s ../../../$$d build/typecheck/mhaserve/$$d; done
	$(BIN)/mypy

pytest: $(VENV)/.stamp-dev .venv-triton/.stamp tests/service/grpc_js/node_modules/.stamp grpc-go-client \
  tests/service/grpc_java/build/.stamp rust-h2-client
	$(PY) -m pytest $(PYTEST_ARGS)

# Node's gRPC client for the interop tests (tests/service/test_grpc_js.py), from the npm registry with the
# machine's Node.js, as the lockfile pins it.
tests/service/grpc_js/node_modules/.stamp: tests/service/grpc_js/package.json tests/service/grpc_js/package-lock.json
	cd tests/service/grpc_js && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# Go's gRPC client for the interop tests (tests/service/test_grpc_go.py), built offline from Debian's Go
# packages (.ci/run installs them); where they are missing the script says so, builds nothing, and those
# tests skip. Phony: the script is quick, and rebuilds only what changed (Go's own cache).
.PHONY: grpc-go-client
grpc-go-client:
	@tests/service/grpc_go/build.sh

# A gRPC client on Rust's h2 crate (hyper's and tonic's HTTP/2) for tests/service/test_rust_h2.py, built
# offline from Debian's crates with the machine's cargo (.ci/run installs what is missing); where they are
# missing the script says so, builds nothing, and those tests skip. Phony: cargo rebuilds only what changed.
.PHONY: rust-h2-client
rust-h2-client:
	@tests/service/rust_h2/build.sh

# Java's gRPC client for the interop tests (tests/service/test_grpc_java.py), built offline from Debian's
# grpc-java on Netty (.ci/run installs it); where it is missing the script says so and those tests skip.
tests/service/grpc_java/build/.stamp: tests/service/grpc_java/Client.java tests/service/grpc_java/build.sh \
  proto/encoder/v1/encoder.proto
	@tests/service/grpc_java/build.sh

# Triton's client for the Open Inference Protocol interop tests (tests/service/test_kserve_triton.py), in a
# venv of its own: tritonclient pins protobuf < 7 and mhaserve's stubs need protobuf >= 7. Nothing of
# mhaserve is installed there; the tests run tests/kserve/triton_client.py with its python.
.venv-triton/.stamp: tests/kserve/requirements.txt
	@test -x .venv-triton/bin/python || $(PYTHON) -m venv .venv-triton
	.venv-triton/bin/python -m pip install -q --upgrade pip
	.venv-triton/bin/python -m pip install -q -r tests/kserve/requirements.txt
	@touch $@

# Stubs are committed; tests/proto checks they match what this recipe generates from the .proto files.
# protoc names the modules by the .proto files' paths (proto.encoder.v1); installed, they are mhaserve.proto.*,
# so their imports of each other are rewritten to that. PROTO_OUT: where to write (tests/proto compares).
PROTO_OUT ?= .
proto: $(VENV)/.stamp-dev proto-generate

.PHONY: proto-generate
proto-generate:
	$(PY) -m grpc_tools.protoc -I . --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
	  $$(find proto -name '*.proto' | sort)
	find $(PROTO_OUT)/proto \( -name '*_pb2.py' -o -name '*_pb2.pyi' -o -name '*_pb2_grpc.py' \) \
	  -exec sed -i -E -e 's/^(from|import) proto\./\1 mhaserve.proto./' \
	  -e "s/(BuildTopDescriptorsAndMessages\(DESCRIPTOR, )'proto\./\1'mhaserve.proto./" {} +

clean:
	rm -rf $(VENV) .venv-triton tests/service/grpc_js/node_modules tests/service/grpc_go/build \
  tests/service/grpc_java/build tests/service/rust_h2/build .pytest_cache .mypy_cache .ruff_cache build *.egg-info

# Load test a running server (`make serve` in another shell) with loadtest/locustfile.py, headless.
# Reports (CSV, JSON, HTML) go to $(LOADTEST_RESULTS)/loadtest-<timestamp>/; the exit status is 1 when
# more than MAX_FAIL_RATIO of the requests failed, or none were made, a user raised, or a call was left
# unanswered at the end (README.md's Load testing says when). PROTOCOL: grpc (encoder.v1, on :50051), http
# (OpenAI POST /v1/embeddings, on :8080; ENCODING_FORMAT float or base64) or tei (text-embeddings-inference's
# POST /embed, on :8080). WORKLOAD: short, query, long,
# mixed, batch, ids, stream (gRPC only), bad, or several separated by commas. PROCESSES > 1 runs Locust
# distributed on this machine.
PROTOCOL ?= grpc
LOADTEST_HOST ?= $(if $(filter http tei,$(PROTOCOL)),http://127.0.0.1:8080,127.0.0.1:50051)
ENCODING_FORMAT ?= float
USERS ?= 32
SPAWN_RATE ?= 8
RUN_TIME ?= 60s
WORKLOAD ?= mixed
BATCH_SIZE ?= 8
MAX_FAIL_RATIO ?= 0.01
PROCESSES ?= 1
LOADTEST_RESULTS ?= results
LOCUST_ARGS ?=

.PHONY: loadtest
loadtest: $(VENV)/.stamp-serve
	@out=$(LOADTEST_RESULTS)/loadtest-$$(date +%Y%m%d-%H%M%S); mkdir -p $$out; \
	echo "locust: $(USERS) users, workload $(WORKLOAD), over $(PROTOCOL) against $(LOADTEST_HOST) for $(RUN_TIME)"; \
	$(BIN)/locust -f loadtest/locustfile.py --headless --host $(LOADTEST_HOST) \
	  --users $(USERS) --spawn-rate $(SPAWN_RATE) --run-time $(RUN_TIME) \
	  $(if $(filter-out 0 1,$(PROCESSES)),--processes $(PROCESSES)) \
	  --protocol $(PROTOCOL) --encoding-format $(ENCODING_FORMAT) \
	  --workload $(WORKLOAD) --batch-size $(BATCH_SIZE) --max-fail-ratio $(MAX_FAIL_RATIO) \
	  --csv $$out/stats --csv-full-history --json-file $$out/stats --html $$out/report.html \
	  --only-summary $(LOCUST_ARGS); \
	rc=$$?; echo "report: $$out/report.html (csv and json beside it); exit status $$rc"; exit $$rc

# The long versions of tests/reliability (loadtest/reliability/): hypothesis over both APIs, a 5x overload
# burst, deadlines and cancellation, engine faults, a 3-minute soak and SIGTERM under load, against $(MODEL)
# on the CPU. Writes docs/reliability.md with the figures; exit status 1 if any check failed. About 10 minutes
# on 2 cores. RELIABILITY_ARGS: e.g. --seed 1, --json results/reliability.json, --quick (a try of the driver).
RELIABILITY_ARGS ?=

.PHONY: reliability
reliability: $(VENV)/.stamp-dev $(REPOSITORY)/$(MODEL)/1/manifest.json
	$(PY) -m mhaserve.loadtest.reliability --repository $(REPOSITORY) --model $(MODEL) --output docs/reliability.md \
	  $(RELIABILITY_ARGS)

# Images with docker or podman, whichever answers (deploy/images/build.sh; CONTAINER_ENGINE picks one): the
# cpu serving image and the loadtest image, or with GPU=1 the gpu serving image and the loadtest image. pip
# in the builds is configured like this host's pip; without a reachable registry the base image is built
# from Debian's packages (deploy/images/base.sh, as root). Tags: CPU_TAG, GPU_TAG, LOADTEST_TAG.
GPU ?=
.PHONY: images
images:
	deploy/images/build.sh $(if $(filter 1 yes true,$(GPU)),gpu,cpu) loadtest

# The figures docs/deploy.md gives for the images (tests/deploy/figures.py): build times, sizes, start to
# SERVING, memory at rest and under load. FIGURES_ARGS: --cold (also a build as on a fresh machine, about
# 12 minutes here), --gpu.
FIGURES_ARGS ?=
.PHONY: image-figures
image-figures: $(VENV)/.stamp-dev
	$(PY) -m tests.deploy.figures $(FIGURES_ARGS)
