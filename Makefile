# Two commands for a fresh machine: `make run` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed
PACKAGES := engine kvtransfer bootstrap prefill_node decode_node gateway planner

.PHONY: proto setup run test test-faults test-tp lint typecheck pytest fetch-model bench-engine bench-gateway clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# Mooncake's CPU wheel links libibverbs even for TCP.
	@if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null)); \
	  else echo "warning: libibverbs1 missing and not root; Mooncake will not import" >&2; fi; \
	fi
	@# CPU torch first, through pip and its configuration: any other spec downloads a multi-GB
	@# CUDA build. The rest through uv, which resolves and downloads in parallel (minutes less).
	@# Everything is compiled to bytecode here, on every core: where PYTHONDONTWRITEBYTECODE is
	@# set (this machine) no process writes it, and each of the suite's ~150 processes compiled
	@# torch from source again (a third of the suite's CPU time). One torch test file is
	@# Python 3.12 syntax: compileall's exit status is not ours.
	@$(BIN)/python -c "import torch" 2>/dev/null || { \
	  $(BIN)/pip install -q --no-compile torch==2.13.0 && \
	  ($(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import torch, os; \
	    print(os.path.dirname(torch.__file__))' 2>/dev/null)" >/dev/null 2>&1 || true); }
	@test -x $(BIN)/uv || $(BIN)/pip install -q uv
	$(BIN)/uv pip install --python $(BIN)/python -q --compile-bytecode -e ".[dev]"
	@touch $(STAMP)

fetch-model: setup
	$(BIN)/pdserve-fetch-model

# A local cluster: bootstrap + 1 prefill + 1 decode + the gateway; Ctrl-C stops it.
run: setup fetch-model
	$(BIN)/pd-cluster --prefill 1 --decode 1

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy $(PACKAGES) scripts

# The suite on every core: xdist gives each worker whole modules (their shared clusters start
# once), and each process one torch thread: two workers whose servers each spin two OpenMP
# threads on two cores only wait for each other.
TEST_WORKERS ?= auto
pytest: setup
	OMP_NUM_THREADS=1 $(BIN)/pytest -q -x -n $(TEST_WORKERS) --dist loadscope --durations=15 \
	  -m "not faults and not tp_matrix"

# Processes killed and frozen under load, both transfer backends (minutes): see tests/test_faults_*.py.
test-faults: setup fetch-model
	$(BIN)/pytest -q -x --durations=15 -m faults -s

test-tp: setup
	$(BIN)/pytest -q -x --durations=15 -m tp_matrix tests/test_tp.py tests/test_tp_disagg.py

test: lint typecheck pytest

# CPU micro-benchmarks (scripts/README.md lists the rest of the tools).
bench-engine: setup fetch-model
	$(BIN)/python -m scripts.bench.engine

bench-gateway: setup fetch-model
	$(BIN)/python -m scripts.bench.gateway

clean:
	rm -rf $(VENV) *.egg-info .mypy_cache .ruff_cache .pytest_cache

# Regenerate the gRPC stubs committed in proto/ (tests/test_proto.py fails when they are stale).
proto: setup
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. proto/*.proto
