# The two commands of the README: `make demo` and `make test`. Both install into $(VENV) first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test install install-test lint protos ptx

$(VENV)/.installed: pyproject.toml cpu_ext/CMakeLists.txt $(wildcard cpu_ext/src/*) $(wildcard cpu_ext/cuda/*)
	@echo "== installing freetoken_jax into $(VENV): jax, flax, numpy, grpcio, FastAPI, tokenizers, llguidance, ... and the C++ executor (about a minute)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	@echo "== installing the test extras: pytest, the CPU build of torch and transformers (the oracle), openai, anthropic (about a minute)"
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

demo: install
	@echo "== generating from the demo model (a 1.6 M-parameter MoE trained on Python's help text)"
	$(VENV)/bin/freetoken-jax generate --model demo --prompt "The for statement" --max-new-tokens 96
	@echo "== benchmarking offload, hybrid and the naive baseline on it (a functional demo on a CPU: GPU figures are in benchmarks/RESULTS.md)"
	$(VENV)/bin/freetoken-jax bench decode --preset demo --strategy offload hybrid naive --slots-gb 0.001 --gen-len 32

test: install-test
	@echo "== running the test suite on two processes"
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

lint: install-test
	$(VENV)/bin/ruff check freetoken_jax pallas_kernels tests benchmarks

# Regenerate the committed gRPC stubs from proto/freetoken.proto (tests check they are current; the
# stubs name the grpcio-tools that wrote them, pinned in pyproject.toml's test extra).
protos: install-test
	$(PY) -m grpc_tools.protoc -Ifreetoken_jax/server/pb=proto --python_out=. --grpc_python_out=. proto/freetoken.proto

# Regenerate the committed PTX of the CUDA kernels from their source (needs nvcc; tests check it is
# current where nvcc is found). compute_80: the oldest GPUs with cp.async; the driver compiles it for
# the device at load.
ptx:
	nvcc -ptx -O3 -arch=compute_80 -o cpu_ext/cuda/q4_0_experts.ptx cpu_ext/cuda/q4_0_experts.cu
